"""What `docker build .` sends as its context: the repository's files filtered by .dockerignore.

Docker's rules (github.com/moby/patternmatcher): patterns are matched against paths relative to
the root, `*` stays within a path segment, `**` spans any number of them, a pattern that matches a
directory matches everything below it, `!` re-includes, and the last matching line wins.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


def _regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def rules(dockerignore: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(excludes?, regex) per line, comments and blanks skipped."""
    found = []
    for line in dockerignore.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        found.append((not negate, _regex(pattern)))
    return found


def excluded(path: str, ignore_rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    verdict = False
    for excludes, regex in ignore_rules:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            verdict = excludes
    return verdict


def context_files(root: Path) -> list[str]:
    """The files of the working tree (tracked or not ignored by git) that the build context holds."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True, check=True).stdout.split()
    ignore_rules = rules((root / ".dockerignore").read_text())
    return sorted(p for p in listed if (root / p).is_file() and not excluded(p, ignore_rules))
