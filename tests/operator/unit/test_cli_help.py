"""`shardctl`'s help and error messages, by snapshot: a file per subcommand's --help and one of
errors, in tests/operator/unit/snapshots/. After a deliberate change, rewrite them with
`SHARD_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/operator/unit/test_cli_help.py` and read the diff.
The rules every command's help follows are checked apart from the snapshots."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from pathlib import Path

import pytest

from shard_operator.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[3]
SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
UPDATE = os.environ.get("SHARD_UPDATE_SNAPSHOTS") == "1"
PLUGINS = {"dev-cluster"}  # another package's command: held to the rules, not snapshotted here
COMMANDS = sorted(set(build_parser()._subparsers._group_actions[0].choices) - PLUGINS)


def matches_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / name
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no snapshot {path.name}: run with SHARD_UPDATE_SNAPSHOTS=1"
    assert text == path.read_text(), f"{path.name} differs: read the diff, and rewrite it with SHARD_UPDATE_SNAPSHOTS=1"


@pytest.fixture(autouse=True)
def steady_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps at the terminal's width


def subcommands(parser: argparse.ArgumentParser | None = None, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every subcommand by its words ("dev-cluster add-node"), nested ones included."""
    found = {}
    for action in (parser or build_parser())._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found[prefix + name] = child
                found.update(subcommands(child, f"{prefix}{name} "))
    return found


@pytest.mark.parametrize("command", ["shardctl", *COMMANDS])
def test_help_matches_its_snapshot(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"] if command == "shardctl" else [command, "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    if command == "shardctl":  # plugins installed here or not: the snapshot holds the product's own
        help_text = "\n".join(line for line in help_text.splitlines() if "dev-cluster" not in line
                              and "run a Kubernetes cluster on this machine" not in line
                              and "pods as local processes" not in line) + "\n"
    matches_snapshot(f"{command}.txt", help_text)


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_command_has_a_description_an_example_and_every_flag_its_help_and_default(command):
    parser = subcommands()[command]
    assert parser.description and len(parser.description) > 40, f"{command}: no description"
    assert (parser.epilog or "").startswith("examples:\n  ") and "shardctl " in parser.epilog, \
        f"{command}: no example"
    one_of = {a for group in parser._mutually_exclusive_groups if group.required for a in group._group_actions}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action in one_of:
            continue
        names = "/".join(action.option_strings) or action.dest
        assert action.help, f"{command} {names}: no help"
        shown = parser.formatter_class(prog="shardctl")._get_help_string(action)
        takes_value = action.option_strings and action.nargs != 0 and not action.required
        assert not takes_value or "default" in shown, f"{command} {names}: its default is not shown"
    home = str(Path.home())
    assert home not in parser.format_help(), f"{command}: a path of this machine in its help"


def test_shardctl_alone_prints_its_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: shardctl") and "plan" in out and "status" in out


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert re.fullmatch(r"shardctl \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


def complete(script: str, *words: str) -> list[str]:
    """What bash completes the last of `words` to, with the script loaded (the real bash)."""
    line = " ".join(words)
    program = (f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _shardctl; "
               'printf "%s\\n" "${COMPREPLY[@]}"')
    return subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True).stdout.split()


def test_bash_completion_knows_commands_flags_choices_and_files(capsys, tmp_path):
    assert main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    assert complete(script, "shardctl", "st") == ["status"]
    assert complete(script, "shardctl", "plan", "--dev") == ["--devices", "--device-kind"]
    assert complete(script, "shardctl", "run", "--device-kind", "") == ["auto", "gpu", "cpu"]
    assert "--max-tokens" in complete(script, "shardctl", "generate", "--max")
    if "dev-cluster" in subcommands():  # a plugin's own actions
        assert complete(script, "shardctl", "dev-cluster", "add") == ["add-node"]
    (tmp_path / "model.yaml").write_text("")
    assert complete(script, "shardctl", "plan", "-f", str(tmp_path / "mo")) == [str(tmp_path / "model.yaml")]


# ---------------------------------------------------------------- errors
TYPO = """apiVersion: sharding.dev/v1alpha1
kind: ShardedModel
metadata: {name: typo}
spec:
  model: {path: m, maxModeLen: 256}
  parallelism: {tensr: 2}
"""
WRONG_PATH = """apiVersion: sharding.dev/v1alpha1
kind: ShardedModel
metadata: {name: lost}
spec:
  model: {path: ../no-such-model}
"""
FIXED = """apiVersion: sharding.dev/v1alpha1
kind: ShardedModel
metadata: {name: fixed}
spec:
  model: {path: models/llama-3-70b, maxModelLen: 8192, maxBatchSize: 8}
  parallelism: {tensor: 2, pipeline: 2}
  replicas: 2
"""
ERRORS = [
    ["plan", "-f", "no-such-file.yaml"],
    ["plan", "-f", "{tmp}/typo.yaml"],
    ["plan", "-f", "{tmp}/lost/lost.yaml"],
    ["plan", "-f", "examples/llama-70b.yaml", "--devices", "a:80*4"],
    ["plan", "-f", "examples/llama-70b.yaml", "--devices", ""],
    ["plan", "-f", "examples/llama-70b.yaml", "--devices", "a:80GiB*4,b:80GiB*0"],
    ["plan", "-f", "examples/llama-70b.yaml", "--devices", "a:24GiB*2"],
    ["plan", "-f", "{tmp}/models/fixed.yaml", "--devices", "a:24GiB*4"],
    ["plan", "-f", "{tmp}/models/fixed.yaml", "--devices", "a:80GiB*4"],
    ["plan", "-f", "examples/llama-70b.yaml", "--devices", "a:80GiB*8", "--tensor", "3"],
    ["status", "--port", "1"],
    ["status"],
]


def test_error_messages_match_their_snapshot(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    (tmp_path / "typo.yaml").write_text(TYPO)
    (tmp_path / "lost").mkdir()
    (tmp_path / "lost" / "lost.yaml").write_text(WRONG_PATH)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "models").symlink_to(ROOT / "examples" / "models")
    (tmp_path / "models" / "fixed.yaml").write_text(FIXED)
    record = []
    for argv in ERRORS:
        argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
        code = main(argv)
        _, err = capsys.readouterr()
        record.append(f"$ shardctl {' '.join(a if a and ' ' not in a else repr(a) for a in argv)}\n"
                      f"exit {code}\n{err}")
    text = "\n".join(record).replace(str(tmp_path), "<tmp>")
    matches_snapshot("errors.txt", text)
    for entry in record:  # every message is one line, or one per fact: never a traceback or an errno
        assert "Traceback" not in entry and "Errno" not in entry
