"""`shardctl`: plan, inspect and run sharded models from the command line.

Every subcommand lives in a function `cmd_<name>(args) -> int` registered in `build_parser`; the
exit status is 0 on success, 1 on bad input, 2 when the model does not fit, 3 when worker ranks
fail (`generate`, `run`) or a group cannot be read (`status`); `run` stopped by SIGTERM exits 143,
by Ctrl-C 130.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from shard_contract.checkpoint import CheckpointError
from shard_contract.env import ENV_NAMES
from shard_contract.units import human
from shard_contract.wire import GenerateRequest, GenerateTask

from . import picture
from .advice import patched
from .api import ShardedModel, ShardedModelSpec, SpecError, load_sharded_models, resolve_model_dir
from .completion import completion_script
from .crd import render as render_crd
from .demo_model import DemoShape as DemoShapeDefaults
from .generate import parse_ids, render_result, result_json, tokenize
from .inventory import Inventory, inventory_from_nodes, load_nodes, local_inventory, local_kind, parse_devices
from .local import LaunchError, check_port, free_port, plan_local, run_generate
from .manifests import Context, Owner, check, desired_objects
from .planner import PlanError, PlannerOptions, consider, plan, shortfall
from .profile import ModelProfile, profile_model
from .report import render_considered, render_plan
from .run import run_local
from .settings import PREFIX, Settings
from .view import StatusError, cluster_status, local_status, watch_status

EXIT_BAD_INPUT = 1
EXIT_INFEASIBLE = 2
EXIT_RANKS_FAILED = 3
PLUGIN_GROUP = "shardctl.commands"  # entry points: functions that add a subcommand to the parser
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


def _cpu_hint(err: PlanError, args: argparse.Namespace, profile: ModelProfile, spec: ShardedModelSpec,
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


# ---------------------------------------------------------------- plan
def cmd_plan(args: argparse.Namespace) -> int:
    model = _pick_model(args.file, args.name)
    spec = spec_for(args, model)
    profile = profile_model(model_dir_for(args, model))
    inventory, options = inventory_for(args, model), planner_options(args)
    name = model.metadata.name
    try:
        result = plan(profile, spec, inventory, options)
    except PlanError as err:
        err = _cpu_hint(err, args, profile, spec, inventory, options)
        picture.write(picture.infeasible_svg(err, f"{name} does not fit"), f"ShardedModel {name}: no plan",
                      f"{err.reason}: {err.message}", args.svg, args.html)
        if args.explain and err.reason == "InsufficientCapacity":
            print(render_considered(consider(profile, spec, inventory, options)[2], None))
        raise err from None
    text = render_plan(result, profile, inventory)
    picture.write(picture.plan_svg(result), f"ShardedModel {name}: the plan", text, args.svg, args.html)
    if args.json:
        print(result.to_json())
    else:
        print(f"ShardedModel {name}")
        print(text)
        if args.explain:
            print()
            print(render_considered(consider(profile, spec, inventory, options)[2], result))
    if missing := shortfall(result, profile, spec, inventory, options):  # the groups that fit are planned
        print(f"shardctl: InsufficientCapacity: {missing.message}", file=sys.stderr)
        return EXIT_INFEASIBLE
    return 0


def cmd_crd(_: argparse.Namespace) -> int:
    sys.stdout.write(render_crd())
    return 0


# ---------------------------------------------------------------- manifests
def cmd_manifests(args: argparse.Namespace) -> int:
    """Print the objects the operator would create, built by the operator's own pure builders."""
    model = _pick_model(args.file, args.name)
    spec = spec_for(args, model)
    ctx = Context(owner=Owner(name=model.metadata.name, namespace=model.metadata.namespace or args.namespace),
                  spec=spec, default_image=args.image or Settings().worker_image,
                  network_policy=not args.no_network_policy)
    check(ctx)
    profile = profile_model(model_dir_for(args, model))
    inventory, options = inventory_for(args, model), planner_options(args)
    try:
        result = plan(profile, spec, inventory, options)
    except PlanError as err:
        raise _cpu_hint(err, args, profile, spec, inventory, options) from None
    sys.stdout.write(yaml.safe_dump_all(desired_objects(ctx, result), sort_keys=False))
    return 0


# ---------------------------------------------------------------- generate
def cmd_generate(args: argparse.Namespace) -> int:
    """Plan the model over TP x PP local ranks, run them as processes, print what they generate."""
    prompt = parse_ids(args.prompt_ids) if args.prompt_ids is not None else tokenize(args.model_dir, args.prompt)
    partition = parse_ids(args.layer_partition) if args.layer_partition else None
    kind = local_kind() if args.device_kind == "auto" else args.device_kind
    result_plan = plan_local(args.model_dir, args.tensor, args.pipeline, dtype=args.dtype,
                             quantization=args.quantization,
                             max_model_len=len(prompt) + args.max_tokens, devices=args.devices,
                             device_kind=kind, layer_partition=partition)
    request = GenerateRequest(prompt_ids=prompt, max_new_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos)
    try:
        result = run_generate(result_plan, args.model_dir, GenerateTask(requests=[request]), timeout=args.timeout,
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
    inventory = inventory_for(args, model, here=True)
    spec = spec_for(args, model).model_copy(update={"replicas": 1})
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
                         out=lambda line: print(line, flush=True), err=lambda line: print(line, file=sys.stderr),
                         tty=sys.stdout.isatty())
    except KeyboardInterrupt:
        print("\nshardctl: stopped every rank", file=sys.stderr)
        return 130


# ---------------------------------------------------------------- status
def cmd_status(args: argparse.Namespace) -> int:
    """A local run's group by its port, or a ShardedModel on a cluster by its name."""
    if (args.name is None) == (args.port is None):
        raise SpecError("give a ShardedModel's NAME (on the cluster of your kubeconfig) or --port of a local run")
    if args.name is not None:
        def read() -> Any:
            return cluster_status(args.name, args.namespace)
    else:
        def read() -> Any:
            return local_status(f"http://{args.host}:{args.port}")
    try:
        return watch_status(read, watch=args.watch, as_json=args.json, tty=sys.stdout.isatty(),
                            out=lambda text: print(text, flush=True))
    except StatusError as err:
        print(f"shardctl: {err}", file=sys.stderr)
        return EXIT_RANKS_FAILED
    except KeyboardInterrupt:
        return 0


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


def cmd_completion(args: argparse.Namespace) -> int:
    sys.stdout.write(completion_script(build_parser(), args.shell))
    return 0


# ---------------------------------------------------------------- wiring
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


def _add_model_args(p: argparse.ArgumentParser) -> None:
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


def _add_devices_args(p: argparse.ArgumentParser, here: bool, group: Any = None) -> None:
    """--devices (in `group`, when given) and --device-kind, the same for every command; `here`:
    the command runs ranks on this machine, so every device of --devices is this machine's."""
    (group or p).add_argument("--devices", metavar="SPEC", help=f"{DEVICES_HELP} (default: this machine's devices)")
    which = "the devices are" if here else "devices on localhost are"
    p.add_argument("--device-kind", choices=("auto", "gpu", "cpu"), default="auto",
                   help=f"what --devices describes; auto: {which} what this machine runs ranks on (its CUDA "
                        "devices, else CPU ranks, as `shardctl run` does)" + ("" if here else ", other nodes' GPUs"))


def _add_pool_args(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--nodes", metavar="NODES.yaml",
                        help="plan for these Nodes, as written by `kubectl get nodes -o yaml` (default: "
                             "--devices, else this machine's devices)")
    _add_devices_args(p, here=False, group=source)
    p.add_argument("--planner-options", metavar="JSON",
                   help="the planner's constants, as the operator's planner_options setting takes them "
                        f"(docs/planner.md; default: ${PLANNER_OPTIONS_ENV}, else the defaults)")


def command(sub: argparse._SubParsersAction, name: str, summary: str, description: str,
            examples: list[str]) -> argparse.ArgumentParser:
    """A subcommand whose --help says what it does and shows how it is used."""
    return sub.add_parser(name, help=summary, description=description,
                          epilog="examples:\n" + "\n".join(f"  {e}" for e in examples))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="shardctl", description=__doc__.splitlines()[0],
                    epilog="Run `shardctl COMMAND --help` for a command's options and examples.")
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {importlib.metadata.version('shard-operator')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = command(sub, "plan", "show where every shard of a ShardedModel would go",
                "Plan a ShardedModel for a pool of devices (Kubernetes Nodes, a device list, or this machine) "
                "and print\nwhere every rank goes and what it holds. Exits 2 when not every replica fits, "
                "saying why and what\nwould fit (each suggestion checked by planning again).",
                ["shardctl plan -f examples/llama-70b.yaml --nodes examples/nodes.yaml",
                 'shardctl plan -f examples/llama-70b.yaml --devices "a:80GiB*4,b:48GiB*4@0.86" --explain',
                 'shardctl plan -f examples/local-demo.yaml --devices "localhost:256MiB*2" --svg plan.svg'])
    _add_model_args(p)
    _add_pool_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (docs/planner.md)")
    p.add_argument("--explain", action="store_true", help="also list the layouts compared and why each lost")
    p.add_argument("--svg", metavar="FILE", help="also draw the placement (or what is missing) as SVG "
                                                 "(default: not drawn)")
    p.add_argument("--html", metavar="FILE", help="also draw it as a self-contained HTML page, with the text "
                                                  "(default: not drawn)")
    p.set_defaults(func=cmd_plan)

    p = command(sub, "manifests", "print the Kubernetes objects the operator would create",
                "Print the objects the operator would create for a ShardedModel on a pool, built by the "
                "operator's\nown builders: pods, headless Services, the plan ConfigMap, the NetworkPolicy.",
                ["shardctl manifests -f examples/llama-70b.yaml --nodes examples/nodes.yaml",
                 'shardctl manifests -f examples/shardedmodel.yaml --model-dir DIR --devices "a:24GiB*2" -n prod'])
    _add_model_args(p)
    p.add_argument("-n", "--namespace", default="default", metavar="NS", help="namespace when the ShardedModel "
                                                                             "names none")
    p.add_argument("--image", metavar="IMAGE",
                   help="worker image when spec.worker.image is unset (default: the operator's, "
                        "SHARD_OPERATOR_WORKER_IMAGE or its built-in one)")
    p.add_argument("--no-network-policy", action="store_true",
                   help="leave out the model's NetworkPolicy "
                        "(as an operator installed with networkPolicy.enabled=false)")
    _add_pool_args(p)
    p.set_defaults(func=cmd_manifests)

    p = command(sub, "run", "serve a ShardedModel on this machine, every rank a local process",
                "Plan a ShardedModel for this machine (or the budgets of --devices), start every rank as a "
                "local\nprocess, show each rank's load progress, and serve an OpenAI-compatible API until "
                "Ctrl-C. A failed\ngroup is reported by rank and cause and restarted.",
                ['shardctl run -f examples/local-demo.yaml --devices "localhost:256MiB*2"',
                 'shardctl run -f examples/local-demo.yaml --prompt "The lighthouse keeper" --max-tokens 16'])
    _add_model_args(p)
    _add_devices_args(p, here=True)
    p.add_argument("--port", type=int, default=8000, help="port of the API; 0 takes a free one")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on")
    p.add_argument("--rendezvous-port", type=int, default=0, metavar="PORT",
                   help="port of rank 0's rendezvous store, on 127.0.0.1 (default: a free one)")
    p.add_argument("--log-dir", metavar="DIR", help="where the ranks write their logs, kept (default: a temporary "
                                                    "directory, removed when the run ends cleanly and kept when a "
                                                    "group failed)")
    p.add_argument("--prompt", help="once ready, send this prompt to /v1/completions, print the answer and stop "
                                    "(default: none; serve until Ctrl-C)")
    p.add_argument("--max-tokens", type=int, default=24, metavar="N", help="new tokens for --prompt")
    p.add_argument("--restarts", type=int, default=2, metavar="N",
                   help="times a failed group is restarted (never for a plan or checkpoint a rank refuses)")
    p.add_argument("--threads", type=int, metavar="N", help="threads per rank (default: cores / ranks)")
    p.add_argument("--ready-timeout", type=float, default=600, metavar="SECONDS",
                   help="seconds to wait for every rank to load")
    p.add_argument("--api-key-file", metavar="FILE", default=os.environ.get(ENV_NAMES["api_key_file"]),
                   help="require the key in FILE on the OpenAI routes (Authorization: Bearer); default: "
                        f"${ENV_NAMES['api_key_file']}, else none")
    p.set_defaults(func=cmd_run)

    p = command(sub, "status", "show a running group: each rank's layers, memory and time",
                "Show a running group, per rank: its layers, predicted and measured memory, and where its "
                "time goes\n(compute, communication, idle), with the plan's predicted decode step beside the "
                "measured one.\nA local run by its port (`shardctl run`), or a ShardedModel on the cluster of "
                "your kubeconfig\n(KUBECONFIG, or ~/.kube/config, as kubectl) by its name: its status, and each group "
                "leader's\n/v1/shards through the API server's pod proxy (which needs `get` on pods/proxy).",
                ["shardctl status --port 8000 --watch", "shardctl status llama-70b -n inference"])
    p.add_argument("name", nargs="?", metavar="NAME", help="a ShardedModel on the cluster (default: none; "
                                                           "give --port for a local run)")
    p.add_argument("-n", "--namespace", metavar="NS",
                   help="the ShardedModel's namespace (default: the kubeconfig context's, else default)")
    p.add_argument("--port", type=int, help="port of a local run's API, as `shardctl run --port` (default: none)")
    p.add_argument("--host", default="127.0.0.1", help="address of the local run")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                   help="refresh every SECONDS until Ctrl-C (default: once; --watch alone: every 2 s)")
    p.add_argument("--json", action="store_true", help="print what was read as JSON")
    p.set_defaults(func=cmd_status)

    p = command(sub, "generate", "run a model sharded over local processes and generate from a prompt",
                "Shard a model directory over tensor x pipeline local rank processes, generate from one "
                "prompt, and\nprint the tokens and what each rank measured; then every rank stops.",
                ['shardctl generate --model-dir .cache/demo-model --tensor 2 --prompt "The lighthouse keeper"',
                 "shardctl generate --model-dir DIR --pipeline 2 --prompt-ids 1,2,3 --max-tokens 8 --json"])
    p.add_argument("--model-dir", required=True, metavar="DIR", help="model directory (config.json + safetensors)")
    p.add_argument("--tensor", type=int, default=1, metavar="N", help="tensor-parallel ranks per stage")
    p.add_argument("--pipeline", type=int, default=1, metavar="N", help="pipeline stages")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json in the model directory)")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=16, metavar="N", help="new tokens to generate")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="runtime dtype; auto: the checkpoint's")
    p.add_argument("--quantization", choices=("none", "int8"), default="none",
                   help="int8: weight-only int8 projections, quantized at load")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling: the smallest set of tokens "
                                                            "whose probabilities add up to this")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the sampler")
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop string, repeatable (default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens even past EOS")
    p.add_argument("--layer-partition", metavar="N,N,...",
                   help="decoder layers per stage, e.g. 2,1,1 (default: the planner's split)")
    _add_devices_args(p, here=True)
    p.add_argument("--threads", type=int, metavar="N", help="threads per rank (default: cores / ranks)")
    p.add_argument("--timeout", type=float, default=600, metavar="SECONDS",
                   help="seconds before the ranks are stopped")
    p.add_argument("--json", action="store_true", help="print token_ids, text and the per-rank table as JSON")
    p.set_defaults(func=cmd_generate)

    p = command(sub, "crd", "print the ShardedModel CustomResourceDefinition",
                "Print the ShardedModel CustomResourceDefinition (the chart installs the same one).",
                ["shardctl crd | kubectl apply -f -"])
    p.set_defaults(func=cmd_crd)

    p = command(sub, "demo-model", "write a random Llama checkpoint to try everything offline",
                "Write a random Llama checkpoint (several safetensors files, a trained BPE tokenizer with a "
                "chat\ntemplate): its answers are noise, but everything else runs as with a real model.",
                ["shardctl demo-model .cache/demo-model", "shardctl demo-model /tmp/tiny --layers 4 --hidden 64 "
                                                          "--intermediate 128 --heads 4 --kv-heads 2"])
    p.add_argument("directory", help="where to write it (created; must be empty unless --force)")
    defaults = DemoShapeDefaults()
    p.add_argument("--layers", type=int, metavar="N", default=defaults.layers, help="decoder layers")
    p.add_argument("--hidden", type=int, metavar="N", default=defaults.hidden, help="hidden size")
    p.add_argument("--intermediate", type=int, metavar="N", default=defaults.intermediate, help="MLP width")
    p.add_argument("--heads", type=int, metavar="N", default=defaults.heads, help="attention heads")
    p.add_argument("--kv-heads", type=int, metavar="N", default=defaults.kv_heads, help="key/value heads")
    p.add_argument("--vocab", type=int, metavar="N", default=defaults.vocab,
                   help="most tokens of the trained tokenizer")
    p.add_argument("--max-positions", type=int, metavar="N", default=defaults.max_positions,
                   help="max_position_embeddings")
    p.add_argument("--files", type=int, metavar="N", default=defaults.files,
                   help="safetensors files to split the weights into")
    p.add_argument("--seed", type=int, metavar="N", default=defaults.seed, help="seed of the random weights")
    p.add_argument("--force", action="store_true", help="replace what the directory holds")
    p.set_defaults(func=cmd_demo_model)

    p = command(sub, "completion", "print a shell completion script",
                "Print a completion script for the shell: subcommands, their flags, the choices of a flag, "
                "and file\nnames where a flag takes a file. zsh reads the bash one after "
                "`autoload -U bashcompinit && bashcompinit`.",
                ["source <(shardctl completion bash)", "shardctl completion bash > ~/.local/share/"
                                                       "bash-completion/completions/shardctl"])
    p.add_argument("shell", choices=("bash",), help="the shell")
    p.set_defaults(func=cmd_completion)

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
