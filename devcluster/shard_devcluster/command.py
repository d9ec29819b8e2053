"""`shardctl dev-cluster`: a Kubernetes cluster on this machine, to try the operator without one.

Importing this module is cheap (argparse only): the cluster's modules load when the command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

MODELS = "/var/lib/shard-operator/models"  # the hostPath of examples/dev-cluster/shardedmodel.yaml


def default_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "shard-operator" / "dev-cluster"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dev-cluster", help="run a Kubernetes cluster on this machine: API server, operator, "
                                           "pods as local processes",
                       description="Run a Kubernetes cluster on this machine for trying the operator: an emulated "
                                   "API server,\nthe operator, and a kubelet that runs pods as local processes; "
                                   "kubectl works against it.",
                       epilog="examples:\n  shardctl dev-cluster --demo-model\n"
                              "  shardctl dev-cluster --nodes examples/dev-cluster/nodes.yaml --faults error=0.05")
    p.add_argument("--dir", type=Path, default=None, metavar="DIR",
                   help="state directory: kubeconfig, logs, and the nodes' filesystem in host/ "
                        "(default: $XDG_CACHE_HOME/shard-operator/dev-cluster, XDG_CACHE_HOME being ~/.cache "
                        "when unset)")
    p.add_argument("--nodes", metavar="NODES.yaml",
                   help="Node objects to start with (default: two nodes of two 200 MiB simulated GPUs, "
                        "as examples/dev-cluster/nodes.yaml)")
    p.add_argument("--demo-model", action="store_true",
                   help=f"write the demo model to {MODELS}/demo-llama on the nodes' filesystem if it is missing")
    p.add_argument("--faults", type=_faults, metavar="SPEC",
                   help="make the API server fail a fraction of requests as a real one under load does, e.g. "
                        "error=0.05,conflict=0.1,timeout=0.02,slow=0.02,delay=2,drop_watch=0.2,watch_life=5,seed=1 "
                        "(docs/dev-cluster.md) (default: none)")
    p.set_defaults(func=run)


def _faults(text: str):
    from .emulator import Faults  # (loads the emulator: only when asked)

    try:
        return Faults.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from shard_operator.inventory import load_nodes

    from .cluster import DevCluster, default_nodes

    nodes = load_nodes(args.nodes) if args.nodes else default_nodes()
    workdir: Path = (args.dir or default_dir()).resolve()
    host_root = workdir / "host"
    if args.demo_model and not (host_root / MODELS.lstrip("/") / "demo-llama" / "config.json").exists():
        from shard_operator.demo_model import write_demo_model

        print(f"writing the demo model to {host_root / MODELS.lstrip('/') / 'demo-llama'} ...", flush=True)
        write_demo_model(host_root / MODELS.lstrip("/") / "demo-llama", overwrite=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    cluster = DevCluster(workdir, host_root=host_root, nodes=nodes, faults=args.faults)
    await cluster.start()
    try:
        assert cluster.proxy is not None and cluster.operator is not None
        cluster.proxy.on_listen = lambda ns, name, url: print(f"service {ns}/{name}: {url}", flush=True)
        cluster.proxy.on_error = lambda message: print(message, file=sys.stderr, flush=True)
        print(banner(cluster, nodes), flush=True)
        operator_exit = asyncio.ensure_future(cluster.operator.wait())
        await asyncio.wait([operator_exit, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if operator_exit.done():
            print(f"the operator exited with status {operator_exit.result()}; see {cluster.operator_log}",
                  file=sys.stderr)
            return 1
        return 0
    finally:
        print("stopping the operator and every pod ...", flush=True)
        await cluster.stop()


def banner(cluster, nodes: list[dict]) -> str:
    from shard_operator.inventory import MEMORY_LABEL

    node_lines = [f"  {n['metadata']['name']}: {n['status']['allocatable'].get('nvidia.com/gpu', 0)} x "
                  f"{n['metadata']['labels'].get(MEMORY_LABEL, '?')} MiB" for n in nodes]
    faults = cluster.emu.faults
    return "\n".join([
        f"dev cluster: API server {cluster.url}, operator log {cluster.operator_log}",
        *([f"the API server fails requests: {faults!r}"] if faults is not None else []),
        "nodes (each GPU is a CPU memory budget the worker on it enforces):", *node_lines,
        f"hostPath volumes lie under {cluster.host_root}",
        "",
        "in another terminal:",
        f"  export KUBECONFIG={cluster.kubeconfig}",
        f"  shardctl demo-model {cluster.host_root / MODELS.lstrip('/') / 'demo-llama'}   # unless --demo-model",
        "  kubectl apply -f examples/dev-cluster/shardedmodel.yaml",
        "  kubectl get shardedmodels -w",
        "then send requests to the model's Service (its address is printed here when it appears):",
        "  curl -s http://SERVICE-IP:8000/v1/completions -H 'Content-Type: application/json' \\",
        "       -d '{\"model\": \"demo\", \"prompt\": \"Hello\", \"max_tokens\": 16}'",
        "Ctrl-C stops everything.",
    ])
