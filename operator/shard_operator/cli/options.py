"""What shardctl's commands share: the help format, the exit statuses, and the options that
name a ShardedModel, its checkpoint, the devices and the planner, with what each resolves to."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from shard_contract.units import human

from ..api import ShardedModel, ShardedModelSpec, SpecError, load_sharded_models, resolve_model_dir
from ..planning import PlanError, PlannerOptions, plan
from ..planning.advice import patched
from ..planning.inventory import Inventory, inventory_from_nodes, load_nodes, local_inventory, local_kind, parse_devices
from ..planning.profile import ModelProfile
from ..settings import PREFIX

EXIT_BAD_INPUT = 1
EXIT_INFEASIBLE = 2
EXIT_RANKS_FAILED = 3
PLANNER_OPTIONS_ENV = PREFIX + "PLANNER_OPTIONS"  # the operator's own setting (settings.py)
SMALL_GPU = 4 * 2**30  # budgets below this planned as GPUs are more likely CPU rank budgets


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written; every option's default at the end of its help,
    unless the help already says it (a computed default says what it is, not this machine's
    value of it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False \
                or action.default == argparse.SUPPRESS or action.required:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """shardctl's parsers, subcommands' (plugins' too) included: the same help format."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def pick_model(path: str, name: str | None) -> ShardedModel:
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


def spec_for(args: argparse.Namespace, model: ShardedModel) -> ShardedModelSpec:
    """The file's spec, with the parallelism --tensor and --pipeline give."""
    given = {k: v for k, v in (("tensor", args.tensor), ("pipeline", args.pipeline)) if v is not None}
    try:
        return patched(model.spec, {"parallelism": given}) if given else model.spec
    except SpecError as err:
        raise SpecError(f"--tensor/--pipeline: {err}") from None


def inventory_for(args: argparse.Namespace, model: ShardedModel, here: bool = False) -> Inventory:
    """--nodes FILE, --devices SPEC, or this machine. `here`: the devices are this machine's (run)."""
    if getattr(args, "nodes", None):
        return inventory_from_nodes(load_nodes(args.nodes), model.spec.placement)
    if args.devices is not None:
        return parse_devices(args.devices, kind=local_kind() if here and args.device_kind == "auto"
                             else args.device_kind)
    return local_inventory()


def planner_options(args: argparse.Namespace) -> PlannerOptions:
    """--planner-options, else the operator's setting from the environment: the same JSON plans here
    as the operator does."""
    given = args.planner_options is not None
    text = args.planner_options if given else os.environ.get(PLANNER_OPTIONS_ENV, "")
    try:
        return PlannerOptions.from_json(text)
    except ValueError as err:
        raise ValueError(f"{'--planner-options' if given else PLANNER_OPTIONS_ENV}: {err}") from None


def model_dir_for(args: argparse.Namespace, model: ShardedModel) -> Path:
    """--model-dir, or spec.model.path (relative to the YAML file); a directory without a
    config.json is named with where its path came from."""
    if args.model_dir:
        return Path(args.model_dir)
    directory = resolve_model_dir(model.spec.model, base=Path(args.file).resolve().parent)
    if not (directory / "config.json").is_file():
        what = "no such directory" if not directory.is_dir() else "no config.json there"
        volume = model.spec.model.volume
        relative = (f", inside the hostPath volume {volume.host_path.path}" if volume is not None and volume.host_path
                    else "" if Path(model.spec.model.path).is_absolute() else f", relative to {args.file}")
        raise SpecError(f"{os.path.normpath(directory)}: {what} (spec.model.path {model.spec.model.path!r}{relative}); "
                        "fix the path or give --model-dir")
    return directory


def cpu_hint(err: PlanError, args: argparse.Namespace, profile: ModelProfile, spec: ShardedModelSpec,
              inventory: Inventory, options: PlannerOptions) -> PlanError:
    """Small budgets planned as GPUs are often CPU rank budgets meant: say so when planning them
    as CPU ranks (as `shardctl run` on a machine without CUDA does) would fit."""
    if args.devices is None or args.device_kind != "auto" or \
            not any(d.kind == "gpu" and d.memory_bytes < SMALL_GPU for d in inventory.devices):
        return err
    as_cpu = Inventory(devices=[d.model_copy(update={"kind": "cpu"}) for d in inventory.devices])
    try:
        plan(profile, spec, as_cpu, options)
    except PlanError:
        return err
    runtime = human(options.runtime_overhead["gpu"])
    return PlanError(err.reason, f"{err.message}\nThese devices were planned as GPUs ({runtime} of runtime each): "
                                 "if they are CPU rank budgets, --device-kind cpu plans them so, and then it fits.",
                     err.shortfall, err.suggestions)


def _degree(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive integer or auto") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive integer or auto")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--file", required=True, metavar="FILE.yaml", help="the ShardedModel YAML")
    p.add_argument("--name", help="which ShardedModel, when the file holds several (default: its only one)")
    p.add_argument("--model-dir", metavar="DIR",
                   help="model directory (config.json + safetensors) (default: spec.model.path, relative to "
                        "the YAML file)")
    p.add_argument("--tensor", type=_degree, metavar="N|auto", help="tensor-parallel degree (default: the spec's)")
    p.add_argument("--pipeline", type=_degree, metavar="N|auto", help="pipeline stages (default: the spec's)")


DEVICES_HELP = ('device budgets instead of this machine\'s, e.g. "node-a:80GiB*4,node-b:24GiB*2@0.3" or '
                '"localhost:256MiB*2": NODE:MEMORY[*COUNT][@SPEED_TBPS][:PRODUCT][+host=GBPS][+files=GBPS], '
                'MEMORY with its unit; host and files: the rates of streamed layers, docs/planner.md')


def add_devices_args(p: argparse.ArgumentParser, here: bool, group: Any = None) -> None:
    """--devices (in `group`, when given) and --device-kind, the same for every command; `here`:
    the command runs ranks on this machine, so every device of --devices is this machine's."""
    (group or p).add_argument("--devices", metavar="SPEC", help=f"{DEVICES_HELP} (default: this machine's devices)")
    which = "the devices are" if here else "devices on localhost are"
    p.add_argument("--device-kind", choices=("auto", "gpu", "cpu"), default="auto",
                   help=f"what --devices describes; auto: {which} what this machine runs ranks on (its CUDA "
                        "devices, else CPU ranks, as `shardctl run` does)" + ("" if here else ", other nodes' GPUs"))


def add_pool_args(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--nodes", metavar="NODES.yaml",
                        help="plan for these Nodes, as written by `kubectl get nodes -o yaml` (default: "
                             "--devices, else this machine's devices)")
    add_devices_args(p, here=False, group=source)
    p.add_argument("--planner-options", metavar="JSON",
                   help="the planner's constants, as the operator's planner_options setting takes them "
                        f"(docs/planner.md; default: ${PLANNER_OPTIONS_ENV}, else the defaults)")


def command(sub: argparse._SubParsersAction, name: str, summary: str, description: str,
            examples: list[str]) -> argparse.ArgumentParser:
    """A subcommand whose --help says what it does and shows how it is used."""
    return sub.add_parser(name, help=summary, description=description,
                          epilog="examples:\n" + "\n".join(f"  {e}" for e in examples))
