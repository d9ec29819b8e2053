"""`shardctl completion bash`: a completion script written from the parser itself. Pure.

The script knows every subcommand (plugins' too), each one's flags, the choices of a flag, and
which flags take a file or a directory (from their metavar: `FILE`, `*.yaml`, `DIR`), so it never
goes stale and needs nothing installed beside bash.
"""

from __future__ import annotations

import argparse
import shlex


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [flag for action in parser._actions for flag in action.option_strings]


def _value_cases(parser: argparse.ArgumentParser) -> list[str]:
    """`case "$prev"` arms: what the value of each flag that takes one completes to."""
    arms = []
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0:
            continue
        flags = "|".join(action.option_strings)
        metavar = str(action.metavar or "")
        if action.choices:
            words = shlex.quote(" ".join(map(str, action.choices)))
            arms.append(f'{flags}) COMPREPLY=($(compgen -W {words} -- "$cur")); return;;')
        elif metavar == "DIR":
            arms.append(f'{flags}) COMPREPLY=($(compgen -d -- "$cur")); return;;')
        elif metavar.endswith((".yaml", "FILE")):
            arms.append(f'{flags}) COMPREPLY=($(compgen -f -- "$cur")); return;;')
        else:
            arms.append(f"{flags}) return;;")  # a value of its own: nothing to offer
    return arms


def completion_script(parser: argparse.ArgumentParser, shell: str = "bash") -> str:
    if shell != "bash":
        raise ValueError(f"no completion for {shell}; bash (zsh: through bashcompinit)")
    prog = parser.prog
    commands = _subcommands(parser)
    top = " ".join([*commands, *_flags(parser)])
    lines = [f"# bash completion for {prog}: source <({prog} completion bash)",
             f"_{prog}() {{",
             '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}" cmd="" i',
             "    for ((i = 1; i < COMP_CWORD; i++)); do",
             '        case "${COMP_WORDS[i]}" in -*) ;; *) cmd="${COMP_WORDS[i]}"; break;; esac',
             "    done",
             '    case "$cmd" in',
             f'        "") COMPREPLY=($(compgen -W {shlex.quote(top)} -- "$cur"));;']
    for name, sub in commands.items():
        lines.append(f"        {name})")
        arms = _value_cases(sub)
        if arms:
            lines.append('            case "$prev" in')
            lines += [f"                {arm}" for arm in arms]
            lines.append("            esac")
        words = " ".join([*_subcommands(sub), *_flags(sub)])  # its own actions (dev-cluster add-node)
        lines.append(f'            COMPREPLY=($(compgen -W {shlex.quote(words)} -- "$cur"));;')
    lines += ["    esac", "}", f"complete -o default -F _{prog} {prog}", ""]
    return "\n".join(lines)
