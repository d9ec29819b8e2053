"""The commands that run ranks on this machine or read running ones: `shardctl run` (serve a
ShardedModel with local rank processes), `generate` (one prompt through a sharded model) and
`status` (a running group, local or on a cluster)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from shard_contract.env import ENV_NAMES
from shard_contract.wire import GenerateRequest, GenerateTask

from ..api import SpecError
from ..local.generate import parse_ids, render_result, result_json, tokenize
from ..local.launcher import LaunchError, check_port, free_port, plan_local, run_generate
from ..local.run import run_local
from ..planning import plan
from ..planning.inventory import local_kind
from ..planning.profile import profile_model
from ..planning.report import render_plan
from .options import (
    EXIT_RANKS_FAILED,
    add_devices_args,
    add_model_args,
    command,
    inventory_for,
    model_dir_for,
    pick_model,
    spec_for,
)
from .view import StatusError, cluster_status, local_status, watch_status


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


def cmd_run(args: argparse.Namespace) -> int:
    """Plan a ShardedModel for this machine's devices and serve it with local rank processes."""
    # A port another process holds would fail every rank 0 this starts: say so before anything starts.
    if args.port:
        check_port(args.host, args.port, "--port")
    if args.rendezvous_port:
        check_port("127.0.0.1", args.rendezvous_port, "--rendezvous-port")
    model = pick_model(args.file, args.name)
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


def add_run(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "run", "serve a ShardedModel on this machine, every rank a local process",
                "Plan a ShardedModel for this machine (or the budgets of --devices), start every rank as a "
                "local\nprocess, show each rank's load progress, and serve an OpenAI-compatible API until "
                "Ctrl-C. A failed\ngroup is reported by rank and cause and restarted.",
                ['shardctl run -f examples/local-demo.yaml --devices "localhost:256MiB*2"',
                 'shardctl run -f examples/local-demo.yaml --prompt "The lighthouse keeper" --max-tokens 16'])
    add_model_args(p)
    add_devices_args(p, here=True)
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


def add_status(sub: argparse._SubParsersAction) -> None:
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


def add_generate(sub: argparse._SubParsersAction) -> None:
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
    add_devices_args(p, here=True)
    p.add_argument("--threads", type=int, metavar="N", help="threads per rank (default: cores / ranks)")
    p.add_argument("--timeout", type=float, default=600, metavar="SECONDS",
                   help="seconds before the ranks are stopped")
    p.add_argument("--json", action="store_true", help="print token_ids, text and the per-rank table as JSON")
    p.set_defaults(func=cmd_generate)
