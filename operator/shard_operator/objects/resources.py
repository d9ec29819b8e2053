"""What a rank pod asks of its node besides its GPUs: CPU and memory requests sized from the plan,
and the size of its memory-backed /dev/shm. Pure.

Without requests a pod is BestEffort, the first to be evicted when its node runs short of memory;
with requests that cover what it uses it is Burstable and stays. No limits are set by default: a
memory limit under a loading rank's peak would OOM-kill it (`spec.worker.resources` sets them).

Per rank:
- memory: what the rank holds in host memory, plus HEADROOM. A GPU rank: HOST_BYTES["gpu"] (the
  interpreter, torch and its CUDA libraries, the host side of the CUDA context, NCCL's proxy and
  shared-memory buffers, the loader's pinned staging buffers, the tokenizer). A CPU rank: a bare
  `import torch` process (HOST_BYTES["cpu"]) and everything the plan predicts, since its weights,
  KV cache and activations are host memory. A rank that streams layers (offload) needs the host
  memory they take on top (the plan's `offload.host_bytes`: a GPU's pinned copies, the page cache
  of the files it reads), whatever `spec.worker.resources` asks per rank, which cannot know what the
  plan streams: it is added to the spec's memory request and limit too.
- cpu: a GPU rank's host thread launches the kernels while NCCL's proxy thread drives its
  transfers (two cores); a CPU rank computes on its core.
- /dev/shm: SHM_BYTES per rank. NCCL keeps its shared-memory transport's buffers there (used
  between the GPUs of one pod that cannot reach each other peer-to-peer: NCCL_BUFFSIZE, 4 MiB, per
  channel and peer, some 256 MiB a rank at 32 channels) and its proxy's; NCCL's container guidance
  is a /dev/shm well above docker's 64 MiB default (`--shm-size=1g`). A memory-backed emptyDir is
  charged to the pod's memory only as far as it is written, so the limit costs nothing unused;
  without one, a runaway writer could take the node's memory.
`spec.worker.resources` are per rank too: a pod of several ranks asks for their sum.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from shard_contract.plan import RankPlan
from shard_contract.units import GiB, MiB, quantity

from ..api import SpecError

HOST_BYTES = {"gpu": 2 * GiB, "cpu": 512 * MiB}
HEADROOM = 0.25
CPU_REQUEST = {"gpu": 2, "cpu": 1}
SHM_BYTES = 1 * GiB
# A non-negative Kubernetes quantity: a number and a suffix (Ki..Ei, m, k..E, or an exponent e3);
# what the API server would refuse ("16GB") is refused here, naming the field
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|)$")


def mebibytes(n: int | Decimal) -> str:
    return f"{math.ceil(n / MiB)}Mi"


def streamed_bytes(rank: RankPlan) -> int:
    """Host memory of the layers a rank streams (offload), exact: no headroom."""
    return rank.offload.host_bytes if rank.offload else 0


def host_bytes(rank: RankPlan) -> int:
    """Host memory one rank needs, with headroom."""
    held = HOST_BYTES[rank.kind] + (rank.predicted_bytes.total if rank.kind == "cpu" else 0)
    return int(held * (1 + HEADROOM)) + streamed_bytes(rank)


def default_requests(ranks: list[RankPlan]) -> dict[str, str]:
    return {"cpu": str(sum(CPU_REQUEST[r.kind] for r in ranks)), "memory": mebibytes(sum(map(host_bytes, ranks)))}


def shm_size(ranks: int) -> str:
    return mebibytes(ranks * SHM_BYTES)


def times(quantity: str, n: int, field: str) -> str:
    """A Kubernetes quantity times `n` ("16Gi" x 2 = "32Gi", "500m" x 2 = "1000m")."""
    match = _QUANTITY.match(quantity)
    if match is None:
        raise SpecError(f"{field}: {quantity!r} is not a quantity this operator can scale (write e.g. 4, 500m, "
                        "16Gi, 16G)")
    try:
        value = Decimal(match[1]) * n
    except InvalidOperation:
        raise SpecError(f"{field}: {quantity!r} is not a number") from None
    return f"{value.normalize():f}{match[2]}"


def check(requests: dict[str, str], limits: dict[str, str]) -> None:
    """Raise SpecError for a quantity that could not be scaled to a pod of several ranks."""
    for kind, values in (("requests", requests), ("limits", limits)):
        for key, value in values.items():
            times(value, 1, f"spec.worker.resources.{kind}.{key}")


def pod_resources(ranks: list[RankPlan], requests: dict[str, str], limits: dict[str, str],
                  gpu_resource: str) -> dict[str, dict[str, str]]:
    """The container resources of a pod holding `ranks`: the defaults, what the spec asks per rank
    (times the pod's ranks), and a GPU per rank."""
    n, where, streamed = len(ranks), "spec.worker.resources", sum(map(streamed_bytes, ranks))

    def per_pod(values: dict[str, str], kind: str) -> dict[str, str]:
        scaled = {k: times(v, n, f"{where}.{kind}.{k}") for k, v in values.items()}
        if streamed and "memory" in scaled:
            scaled["memory"] = mebibytes(quantity(scaled["memory"]) + streamed)
        return scaled

    gpus = {gpu_resource: str(n)}
    asked = per_pod(requests, "requests")
    # Extended resources (rdma/..., a vendor's NICs) cannot be overcommitted: Kubernetes wants them
    # in limits, equal to the request; the spec may name them in either.
    extended = {k: v for k, v in asked.items() if extended_resource(k)}
    return {"requests": {**default_requests(ranks), **asked, **gpus},
            "limits": {**extended, **per_pod(limits, "limits"), **gpus}}


def extended_resource(name: str) -> bool:
    """A resource outside kubernetes.io's own (cpu, memory, hugepages-*, ephemeral-storage)."""
    return "/" in name and not name.split("/", 1)[0].endswith("kubernetes.io")


def threads_per_rank(rank: RankPlan, requests: dict[str, str]) -> int:
    """The threads a rank computes with (OMP_NUM_THREADS): the CPUs it asks for, at least one."""
    cpu = requests.get("cpu")
    return max(1, int(quantity(cpu)) if cpu is not None else CPU_REQUEST[rank.kind])
