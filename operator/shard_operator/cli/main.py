"""`shardctl`: plan, inspect and run sharded models from the command line.

Every subcommand is a function `cmd_<name>(args) -> int` beside its `add_<name>` (its options and
help) in the module of its family, and `build_parser` adds them in the order `--help` lists them; the
exit status is 0 on success, 1 on bad input, 2 when the model does not fit, 3 when worker ranks
fail (`generate`, `run`) or a group cannot be read (`status`); `run` stopped by SIGTERM exits 143,
by Ctrl-C 130.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

from shard_contract.checkpoint import CheckpointError

from ..api import SpecError
from ..planning import PlanError
from . import planning, running, tools
from .options import EXIT_BAD_INPUT, EXIT_INFEASIBLE, Parser

PLUGIN_GROUP = "shardctl.commands"  # entry points: functions that add a subcommand to the parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="shardctl", description=__doc__.splitlines()[0],
                    epilog="Run `shardctl COMMAND --help` for a command's options and examples.")
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {importlib.metadata.version('shard-operator')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    planning.add_plan(sub)
    planning.add_manifests(sub)
    running.add_run(sub)
    running.add_status(sub)
    running.add_generate(sub)
    planning.add_crd(sub)
    tools.add_demo_model(sub)
    tools.add_completion(sub)
    add_plugin_commands(sub)
    parser.set_defaults(root_parser=parser)  # `completion` writes its script from the whole parser
    return parser


def add_plugin_commands(sub: argparse._SubParsersAction) -> None:
    """Subcommands other packages add (`shardctl dev-cluster` comes from shard_devcluster): the
    product never imports them by name, and an install without them simply lacks the command."""
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            add_parser = entry.load()
        except ImportError:
            continue
        add_parser(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except BrokenPipeError:  # `shardctl plan --json | head`: the reader left, nothing to report
        sys.stdout = open(os.devnull, "w")
        return 0
    except PlanError as err:
        print(f"shardctl: {err.reason}: {err.message}", file=sys.stderr)
        return EXIT_INFEASIBLE if err.reason in ("InsufficientCapacity", "NoDevices") else EXIT_BAD_INPUT
    except OSError as err:  # one line, naming the file: not Python's errno form
        where = f"{err.filename}: " if err.filename else ""
        print(f"shardctl: {where}{err.strerror or err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (SpecError, CheckpointError, ValueError) as err:
        print(f"shardctl: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
