"""`shardctl`: plan, inspect and run sharded models from the command line.

Every subcommand lives in a function `cmd_<name>(args) -> int` registered in `build_parser`; the
exit status is 0 on success, 1 on bad input, 2 when the model does not fit, 3 when worker ranks
fail (`generate`, `run`); `run` stopped by SIGTERM exits 143, by Ctrl-C 130.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from pathlib import Path

import yaml

from shard_contract.checkpoint import CheckpointError
from shard_contract.env import ENV_NAMES
from shard_contract.wire import GenerateRequest, GenerateTask

from . import picture
from .api import ShardedModel, SpecError, load_sharded_models, resolve_model_dir
from .crd import render as render_crd
from .demo_model import DemoShape as DemoShapeDefaults
from .generate import parse_ids, render_result, result_json, tokenize
from .inventory import Inventory, inventory_from_nodes, load_nodes, local_inventory, parse_devices
from .local import LaunchError, check_port, free_port, plan_local, run_generate
from .manifests import Context, Owner, check, desired_objects
from .planner import PlanError, PlannerOptions, plan, shortfall
from .profile import profile_model
from .report import render_plan
from .run import run_local
from .settings import PREFIX, Settings

EXIT_BAD_INPUT = 1
EXIT_INFEASIBLE = 2
EXIT_RANKS_FAILED = 3
PLUGIN_GROUP = "shardctl.commands"  # entry points: functions that add a subcommand to the parser
PLANNER_OPTIONS_ENV = PREFIX + "PLANNER_OPTIONS"  # the operator's own setting (settings.py)


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
    if getattr(args, "model_dir", None):
        return Path(args.model_dir)
    return resolve_model_dir(model.spec.model, base=Path(args.file).resolve().parent)


# ---------------------------------------------------------------- plan
def cmd_plan(args: argparse.Namespace) -> int:
    model = _pick_model(args.file, args.name)
    profile = profile_model(model_dir_for(args, model))
    inventory = inventory_for(args, model)
    name = model.metadata.name
    try:
        result = plan(profile, model.spec, inventory, planner_options(args))
    except PlanError as err:
        picture.write(picture.infeasible_svg(err, f"{name} does not fit"), f"ShardedModel {name}: no plan",
                      f"{err.reason}: {err.message}", args.svg, args.html)
        raise
    text = render_plan(result, profile, inventory)
    picture.write(picture.plan_svg(result), f"ShardedModel {name}: the plan", text, args.svg, args.html)
    if args.json:
        print(result.to_json())
    else:
        print(f"ShardedModel {name}")
        print(text)
    if missing := shortfall(result, inventory):  # the groups that fit are planned; the rest is not
        print(f"shardctl: InsufficientCapacity: {missing}", file=sys.stderr)
        return EXIT_INFEASIBLE
    return 0


def cmd_crd(_: argparse.Namespace) -> int:
    sys.stdout.write(render_crd())
    return 0


# ---------------------------------------------------------------- manifests
def cmd_manifests(args: argparse.Namespace) -> int:
    """Print the objects the operator would create, built by the operator's own pure builders."""
    model = _pick_model(args.file, args.name)
    ctx = Context(owner=Owner(name=model.metadata.name, namespace=model.metadata.namespace or args.namespace),
                  spec=model.spec, default_image=args.image, network_policy=not args.no_network_policy)
    check(ctx)
    profile = profile_model(model_dir_for(args, model))
    result = plan(profile, model.spec, inventory_for(args, model), planner_options(args))
    sys.stdout.write(yaml.safe_dump_all(desired_objects(ctx, result), sort_keys=False))
    return 0


# ---------------------------------------------------------------- generate
def cmd_generate(args: argparse.Namespace) -> int:
    """Plan the model over TP x PP local ranks, run them as processes, print what they generate."""
    prompt = parse_ids(args.prompt_ids) if args.prompt_ids is not None else tokenize(args.model, args.prompt)
    partition = parse_ids(args.layer_partition) if args.layer_partition else None
    result_plan = plan_local(args.model, args.tp, args.pp, dtype=args.dtype, quantization=args.quantization,
                             max_model_len=len(prompt) + args.max_new_tokens, devices=args.devices,
                             device_kind=args.device_kind, layer_partition=partition)
    request = GenerateRequest(prompt_ids=prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos)
    try:
        result = run_generate(result_plan, args.model, GenerateTask(requests=[request]), timeout=args.timeout,
                              threads_per_rank=args.threads)
    except LaunchError as err:
        print(f"shardctl: {err}", file=sys.stderr)
        return EXIT_RANKS_FAILED
    print(json.dumps(result_json(result), indent=2) if args.json else render_result(result))
    return 0


# ---------------------------------------------------------------- run
def cmd_run(args: argparse.Namespace) -> int:
    """Plan a ShardedModel for this machine's devices and serve it with local rank processes."""
    # A port another process holds would fail every rank 0 this starts: say so before anything starts.
    if args.port:
        check_port(args.host, args.port, "--port")
    if args.rendezvous_port:
        check_port("127.0.0.1", args.rendezvous_port, "--rendezvous-port")
    model = _pick_model(args.file, args.name)
    model_dir = model_dir_for(args, model)
    profile = profile_model(model_dir)
    inventory = parse_devices(args.devices, kind=args.device_kind) if args.devices else local_inventory()
    spec = model.spec.model_copy(update={"replicas": 1})
    result = plan(profile, spec, inventory)
    port = args.port or free_port()
    print(f"ShardedModel {model.metadata.name}" + (f" (serving 1 of its {model.spec.replicas} replicas here)"
                                                   if model.spec.replicas > 1 else ""))
    print(render_plan(result, profile, inventory), flush=True)
    try:
        return run_local(result, model_dir, port=port, host=args.host, model_name=model.metadata.name,
                         prompt=args.prompt, max_tokens=args.max_tokens, restarts=args.restarts,
                         threads_per_rank=args.threads, ready_timeout=args.ready_timeout,
                         rendezvous_port=args.rendezvous_port or None, log_dir=args.log_dir,
                         api_key_file=args.api_key_file,
                         out=lambda line: print(line, flush=True), err=lambda line: print(line, file=sys.stderr))
    except KeyboardInterrupt:
        print("\nshardctl: stopped every rank", file=sys.stderr)
        return 130


def cmd_demo_model(args: argparse.Namespace) -> int:
    from .demo_model import DemoShape, describe, write_demo_model

    shape = DemoShape(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
                      kv_heads=args.kv_heads, vocab=args.vocab, max_positions=args.max_positions,
                      files=args.files, seed=args.seed)
    try:
        directory = write_demo_model(args.directory, shape, overwrite=args.force)
    except FileExistsError as err:
        print(f"shardctl: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(describe(directory))
    return 0


# ---------------------------------------------------------------- wiring
def _add_inventory_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--nodes", metavar="NODES.yaml", help="Nodes as written by `kubectl get nodes -o yaml`")
    source.add_argument("--devices", metavar="SPEC",
                        help='compact device list, e.g. "node-a:80GiB*4,node-b:24GiB*2@0.3" '
                             "(NODE:MEMORY[*COUNT][@SPEED_TBPS][:PRODUCT][+host=GBPS][+files=GBPS]; host and "
                             "files: the rates of streamed layers, docs/planner.md)")
    parser.add_argument("--device-kind", choices=("gpu", "cpu"), default="gpu",
                        help="what --devices describes (default gpu)")
    parser.add_argument("--planner-options", metavar="JSON",
                        help="the planner's constants, as the operator's planner_options setting takes them "
                             f"(docs/planner.md; default: ${PLANNER_OPTIONS_ENV}, else the defaults)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardctl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="show where every shard of a ShardedModel would go")
    p.add_argument("-f", "--file", required=True, help="ShardedModel YAML")
    p.add_argument("--name", help="which ShardedModel, when the file holds several")
    p.add_argument("--model-dir", help="model directory (default: from spec.model)")
    _add_inventory_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (docs/planner.md)")
    p.add_argument("--svg", metavar="FILE", help="also draw the placement (or what is missing) as SVG")
    p.add_argument("--html", metavar="FILE", help="also draw it as a self-contained HTML page, with the text")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("crd", help="print the ShardedModel CustomResourceDefinition")
    p.set_defaults(func=cmd_crd)

    p = sub.add_parser("manifests", help="print the Kubernetes objects the operator would create")
    p.add_argument("-f", "--file", required=True, help="ShardedModel YAML")
    p.add_argument("--name", help="which ShardedModel, when the file holds several")
    p.add_argument("--model-dir", help="model directory to profile (default: from spec.model)")
    p.add_argument("--namespace", default="default", help="when the ShardedModel names none (default: default)")
    p.add_argument("--image", default=Settings().worker_image, help="worker image when spec.worker.image is unset")
    p.add_argument("--no-network-policy", action="store_true",
                   help="leave out the model's NetworkPolicy (as an operator installed with networkPolicy.enabled=false)")
    _add_inventory_args(p)
    p.set_defaults(func=cmd_manifests)

    p = sub.add_parser("generate", help="run a model sharded over local processes and generate from a prompt")
    p.add_argument("--model", required=True, help="model directory (config.json + safetensors)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json in the model directory)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="runtime dtype (default: the checkpoint's)")
    p.add_argument("--quantization", choices=("none", "int8"), default="none",
                   help="int8: weight-only int8 projections, quantized at load (default none)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens even past EOS")
    p.add_argument("--layer-partition", help="decoder layers per stage, e.g. 2,1,1")
    p.add_argument("--devices", metavar="SPEC", help="devices to plan on, e.g. local:8GiB*4 (default: this machine)")
    p.add_argument("--device-kind", choices=("gpu", "cpu"), default="cpu", help="what --devices describes (default cpu)")
    p.add_argument("--threads", type=int, help="threads per rank (default: cores / ranks)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are stopped")
    p.add_argument("--json", action="store_true", help="print token_ids, text and the per-rank table as JSON")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("run", help="serve a ShardedModel on this machine: every rank a local process, "
                                   "an OpenAI-compatible API on localhost")
    p.add_argument("-f", "--file", required=True, help="ShardedModel YAML")
    p.add_argument("--name", help="which ShardedModel, when the file holds several")
    p.add_argument("--model-dir", help="model directory (default: from spec.model)")
    p.add_argument("--devices", metavar="SPEC",
                   help='local device budgets to plan on, e.g. "localhost:160MiB*2" (default: this machine)')
    p.add_argument("--device-kind", choices=("gpu", "cpu"), default="cpu", help="what --devices describes (default cpu)")
    p.add_argument("--port", type=int, default=8000, help="port of the API (default 8000; 0: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--rendezvous-port", type=int, default=0,
                   help="port of rank 0's rendezvous store, on 127.0.0.1 (default: a free one)")
    p.add_argument("--log-dir", help="where the ranks write their logs, kept (default: a temporary directory, "
                                     "removed when the run ends cleanly and kept when a group failed)")
    p.add_argument("--prompt", help="once ready, send this prompt to /v1/completions, print the answer and stop")
    p.add_argument("--max-tokens", type=int, default=24, help="new tokens for --prompt (default 24)")
    p.add_argument("--restarts", type=int, default=2, help="times a failed group is restarted (default 2)")
    p.add_argument("--threads", type=int, help="threads per rank (default: cores / ranks)")
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for every rank to load")
    p.add_argument("--api-key-file", metavar="FILE", default=os.environ.get(ENV_NAMES["api_key_file"]),
                   help="require the key in FILE on the OpenAI routes (Authorization: Bearer); default: "
                        f"${ENV_NAMES['api_key_file']}, else none")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("demo-model", help="write a random Llama checkpoint (several safetensors files, a trained "
                                          "BPE tokenizer with a chat template) to try everything offline")
    p.add_argument("directory", help="where to write it (created; must be empty unless --force)")
    defaults = DemoShapeDefaults()
    p.add_argument("--layers", type=int, default=defaults.layers)
    p.add_argument("--hidden", type=int, default=defaults.hidden)
    p.add_argument("--intermediate", type=int, default=defaults.intermediate, help="MLP width")
    p.add_argument("--heads", type=int, default=defaults.heads)
    p.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    p.add_argument("--vocab", type=int, default=defaults.vocab, help="most tokens of the trained tokenizer")
    p.add_argument("--max-positions", type=int, default=defaults.max_positions)
    p.add_argument("--files", type=int, default=defaults.files, help="safetensors files to split the weights into")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--force", action="store_true", help="replace what the directory holds")
    p.set_defaults(func=cmd_demo_model)

    add_plugin_commands(sub)
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
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `shardctl plan --json | head`: the reader left, nothing to report
        sys.stdout = open(os.devnull, "w")
        return 0
    except PlanError as err:
        print(f"shardctl: {err.reason}: {err.message}", file=sys.stderr)
        return EXIT_INFEASIBLE if err.reason in ("InsufficientCapacity", "NoDevices") else EXIT_BAD_INPUT
    except (SpecError, CheckpointError, ValueError, OSError) as err:
        print(f"shardctl: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
