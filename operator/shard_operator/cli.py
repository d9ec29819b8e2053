"""`shardctl`: plan, inspect and run sharded models from the command line.

Every subcommand lives in a function `cmd_<name>(args) -> int` registered in `build_parser`; the
exit status is 0 on success, 1 on bad input, 2 when the model does not fit.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .api import SpecError, ShardedModel, load_sharded_models, resolve_model_dir
from .crd import render as render_crd
from .inventory import Inventory, inventory_from_nodes, load_nodes, local_inventory, parse_devices
from .planner import PlanError, plan
from .profile import ProfileError, profile_model
from .report import render_plan

EXIT_BAD_INPUT = 1
EXIT_INFEASIBLE = 2


def _pick_model(path: str, name: str | None) -> ShardedModel:
    models = load_sharded_models(path)
    if name is None:
        if len(models) > 1:
            names = ", ".join(m.metadata.name for m in models)
            raise SpecError(f"{path} holds several ShardedModels ({names}); choose one with --name")
        return models[0]
    for model in models:
        if model.metadata.name == name:
            return model
    raise SpecError(f"{path}: no ShardedModel named {name}")


def inventory_for(args: argparse.Namespace, model: ShardedModel) -> Inventory:
    """--nodes FILE, --devices SPEC, or this machine."""
    if getattr(args, "nodes", None):
        return inventory_from_nodes(load_nodes(args.nodes), model.spec.placement)
    if getattr(args, "devices", None):
        return parse_devices(args.devices, kind="gpu" if args.device_kind == "gpu" else "cpu")
    return local_inventory()


def model_dir_for(args: argparse.Namespace, model: ShardedModel) -> Path:
    if getattr(args, "model_dir", None):
        return Path(args.model_dir)
    return resolve_model_dir(model.spec.model, base=Path(args.file).resolve().parent)


# ---------------------------------------------------------------- plan
def cmd_plan(args: argparse.Namespace) -> int:
    model = _pick_model(args.file, args.name)
    profile = profile_model(model_dir_for(args, model))
    inventory = inventory_for(args, model)
    result = plan(profile, model.spec, inventory)
    if args.json:
        print(result.to_json())
    else:
        print(f"ShardedModel {model.metadata.name}")
        print(render_plan(result, profile, inventory))
    return 0


def cmd_crd(_: argparse.Namespace) -> int:
    sys.stdout.write(render_crd())
    return 0


# ---------------------------------------------------------------- wiring
def _add_inventory_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--nodes", metavar="NODES.yaml", help="Nodes as written by `kubectl get nodes -o yaml`")
    source.add_argument("--devices", metavar="SPEC",
                        help='compact device list, e.g. "node-a:80GiB*4,node-b:24GiB*2@0.3" '
                             "(NODE:MEMORY[*COUNT][@SPEED_TBPS][:PRODUCT])")
    parser.add_argument("--device-kind", choices=("gpu", "cpu"), default="gpu",
                        help="what --devices describes (default gpu)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardctl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="show where every shard of a ShardedModel would go")
    p.add_argument("-f", "--file", required=True, help="ShardedModel YAML")
    p.add_argument("--name", help="which ShardedModel, when the file holds several")
    p.add_argument("--model-dir", help="model directory (default: from spec.model)")
    _add_inventory_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (docs/planner.md)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("crd", help="print the ShardedModel CustomResourceDefinition")
    p.set_defaults(func=cmd_crd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `shardctl plan --json | head`: the reader left, nothing to report
        sys.stdout = open(os.devnull, "w")
        return 0
    except PlanError as err:
        print(f"shardctl: {err.reason}: {err.message}", file=sys.stderr)
        return EXIT_INFEASIBLE if err.reason in ("InsufficientCapacity", "NoDevices") else EXIT_BAD_INPUT
    except (SpecError, ProfileError, ValueError, OSError) as err:
        print(f"shardctl: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
