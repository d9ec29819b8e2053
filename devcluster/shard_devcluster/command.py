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
                              "  shardctl dev-cluster --nodes examples/dev-cluster/nodes.yaml --faults error=0.05\n"
                              "  shardctl dev-cluster --kubeconfig admin.conf --no-operator"
                              "   # beside the chart's operator\n"
                              "  shardctl dev-cluster add-node sim-c   # beside a running one")
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
    p.add_argument("--kubeconfig", type=Path, metavar="FILE",
                   help="attach to the API server (and its scheduler and controllers) this kubeconfig names instead "
                        "of starting the emulated one: the kubelet, the Service proxy and the operator run here "
                        "(docs/dev-cluster.md) (default: start the emulated API server)")
    p.add_argument("--no-operator", dest="operator", action="store_false",
                   help="start no operator: the one the attached cluster runs (the Helm chart's, with its own RBAC) "
                        "reconciles, or none (default: start one, with the kubeconfig's credentials)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve the operator's /metrics on 127.0.0.1:PORT; it must be free (default: 0, no metrics)")
    p.add_argument("--node-selector", default="", metavar="LABELS",
                   help="the kubelet serves only the Nodes these labels select (default: every Node), e.g. "
                        "sharding.dev/device-kind=cpu beside real kubelets")
    p.set_defaults(func=run)
    actions = p.add_subparsers(dest="action", metavar="{add-node}",
                               help="another action instead of running the cluster (default: run it)")
    add = actions.add_parser("add-node", help="add a Node of simulated GPUs to the running dev cluster",
                             description="Add a Node of simulated GPUs (CPU memory budgets) to a running dev "
                                         "cluster, or to the API server\nof --kubeconfig; its kubelet serves it "
                                         "at once. `kubectl delete node NAME` removes it.",
                             epilog="examples:\n  shardctl dev-cluster add-node sim-c\n"
                                    "  shardctl dev-cluster add-node big --gpus 4 --memory 1GiB --speed 2")
    add.add_argument("name", help="the Node's name")
    add.add_argument("--gpus", type=int, default=2, help="simulated GPUs")
    add.add_argument("--memory", type=_mib, default=200, metavar="SIZE",
                     help="memory of each, with its unit, e.g. 512MiB (default: 200MiB)")
    add.add_argument("--pool", default="dev", help="its sharding.dev/pool label")
    add.add_argument("--speed", type=float, metavar="TBPS",
                     help="memory bandwidth in TB/s, its sharding.dev/gpu-speed label (default: unlabelled, "
                          "so the planner takes 1 as for any unknown product)")
    add.add_argument("--dir", type=Path, default=None, metavar="DIR",
                     help="the dev cluster's state directory, where its kubeconfig is (default: as dev-cluster's)")
    add.add_argument("--kubeconfig", type=Path, metavar="FILE",
                     help="the API server's kubeconfig instead (default: the one in --dir)")
    add.set_defaults(func=add_node)


def _faults(text: str):
    from .apirules import Faults  # (loads kmock: only when asked)

    try:
        return Faults.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _mib(text: str) -> int:
    from shard_contract.units import MiB, parse_bytes

    try:
        size = parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if size < MiB:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least 1MiB")
    return size // MiB


def run(args: argparse.Namespace) -> int:
    if args.kubeconfig is not None and args.faults is not None:
        print("--faults is the emulated API server's: not with --kubeconfig", file=sys.stderr)
        return 2
    if args.metrics_port and not args.operator:
        print("--metrics-port is the operator's: not with --no-operator", file=sys.stderr)
        return 2
    if args.metrics_port and not _free(args.metrics_port):
        print(f"--metrics-port {args.metrics_port}: 127.0.0.1:{args.metrics_port} is taken; give a free port",
              file=sys.stderr)
        return 2
    return asyncio.run(_serve(args))


def _free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def add_node(args: argparse.Namespace) -> int:
    return asyncio.run(_add_node(args))


async def _add_node(args: argparse.Namespace) -> int:
    from .cluster import sim_node
    from .kubeapi import ApiStatusError, KubeApi, path

    kubeconfig = args.kubeconfig or (args.dir or default_dir()).resolve() / "kubeconfig"
    if not kubeconfig.is_file():
        print(f"{kubeconfig}: no such kubeconfig; is `shardctl dev-cluster` running (--dir)?", file=sys.stderr)
        return 1
    api = KubeApi.from_kubeconfig(kubeconfig)
    try:
        created = await api.create(path("v1/nodes"), sim_node(args.name, gpus=args.gpus, memory_mib=args.memory,
                                                              pool=args.pool, speed=args.speed))
    except (ApiStatusError, OSError) as err:
        print(f"node/{args.name}: {err}", file=sys.stderr)
        return 1
    finally:
        await api.close()
    print(f"node/{args.name} {'created' if created else 'exists already'}")
    return 0


async def _serve(args: argparse.Namespace) -> int:
    from shard_operator.planning.inventory import load_nodes

    from .cluster import DevCluster, default_nodes

    nodes = load_nodes(args.nodes) if args.nodes else [] if args.kubeconfig else default_nodes()
    workdir: Path = (args.dir or default_dir()).resolve()
    host_root = workdir / "host"
    if args.demo_model and not (host_root / MODELS.lstrip("/") / "demo-llama" / "config.json").exists():
        from shard_operator.local.demo_model import write_demo_model

        print(f"writing the demo model to {host_root / MODELS.lstrip('/') / 'demo-llama'} ...", flush=True)
        write_demo_model(host_root / MODELS.lstrip("/") / "demo-llama", overwrite=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    metrics = {"METRICS_PORT": str(args.metrics_port), "BIND_ADDRESS": "127.0.0.1"} if args.metrics_port else {}
    cluster = DevCluster(workdir, host_root=host_root, nodes=nodes, faults=args.faults, attach=args.kubeconfig,
                         node_selector=args.node_selector, run_operator=args.operator, operator_env=metrics)
    await cluster.start()
    try:
        assert cluster.proxy is not None
        cluster.proxy.on_listen = lambda ns, name, url: print(f"service {ns}/{name}: {url}", flush=True)
        cluster.proxy.on_error = lambda message: print(message, file=sys.stderr, flush=True)
        print(banner(cluster, args.metrics_port), flush=True)
        operator_exit = asyncio.ensure_future(cluster.operator.wait()) if cluster.operator is not None else None
        await asyncio.wait([f for f in (operator_exit, asyncio.ensure_future(stop.wait())) if f is not None],
                           return_when=asyncio.FIRST_COMPLETED)
        if operator_exit is not None and operator_exit.done():
            print(f"the operator exited with status {operator_exit.result()}; see {cluster.operator_log}",
                  file=sys.stderr)
            return 1
        return 0
    finally:
        print("stopping the operator and every pod ...", flush=True)
        await cluster.stop()


def banner(cluster, metrics_port: int = 0) -> str:
    from shard_operator.planning.inventory import MEMORY_LABEL

    assert cluster.kubelet is not None
    nodes = list(cluster.kubelet.nodes.objects.values())
    node_lines = [f"  {n['metadata']['name']}: {n['status'].get('allocatable', {}).get('nvidia.com/gpu', 0)} x "
                  f"{n['metadata'].get('labels', {}).get(MEMORY_LABEL, '?')} MiB" for n in nodes]
    faults = cluster.emu.faults if cluster.emu is not None else None
    server = f"attached to the API server {cluster.url}" if cluster.attach else f"API server {cluster.url}"
    operator = f"operator log {cluster.operator_log}" if cluster.operator is not None else "no operator (--no-operator)"
    return "\n".join([
        f"dev cluster: {server}, {operator}",
        *([f"the operator's metrics: http://127.0.0.1:{metrics_port}/metrics"] if metrics_port else []),
        *([f"the API server fails requests: {faults!r}"] if faults is not None else []),
        "nodes (each GPU is a CPU memory budget the worker on it enforces; `shardctl dev-cluster add-node NAME`, "
        "or kubectl apply/delete of Nodes, changes them):", *node_lines,
        f"hostPath volumes lie under {cluster.host_root}",
        "",
        "in another terminal:",
        f"  export KUBECONFIG={cluster.kubeconfig}",
        f"  shardctl demo-model {cluster.host_root / MODELS.lstrip('/') / 'demo-llama'}   # unless --demo-model",
        "  kubectl apply -f examples/dev-cluster/shardedmodel.yaml",
        "  kubectl get shardedmodels -w",
        "then send requests to the model's URL (the URL column) through the cluster network's proxy:",
        f"  export http_proxy={cluster.gateway.url}",
        "  curl -s http://demo.default.svc:8000/v1/completions -H 'Content-Type: application/json' \\",
        "       -d '{\"model\": \"demo\", \"prompt\": \"Hello\", \"max_tokens\": 16}'",
        "(each Service's address on this machine is printed here too when it appears)",
        "Ctrl-C stops everything.",
    ])
