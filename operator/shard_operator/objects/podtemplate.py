"""What every pod of the worker image carries besides the worker's own environment (WorkerEnv) and
volumes: its security context, what a cluster admin sets (pull secrets, service account, priority),
and each rank's thread count, device order and NCCL policy. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shard_contract.env import ENV_NAMES
from shard_contract.plan import RankPlan

from ..api import ShardedModelSpec, SpecError
from . import resources


def security(add: Sequence[str] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    # The image's own (numeric, non-root) user runs the worker; root is refused. `add`: capabilities
    # the spec asks for (IPC_LOCK for RDMA); for a non-root process Kubernetes puts them in the
    # bounding set only (kubernetes/kubernetes#56374): docs/operations.md, RDMA.
    pod = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                 "capabilities": {"drop": ["ALL"], **({"add": list(add)} if add else {})}}
    return pod, container


def pod_extras(spec: ShardedModelSpec) -> dict[str, Any]:
    """What a cluster admin sets on the pods that run the worker image: pull secrets, service
    account, priority."""
    worker = spec.worker
    extras: dict[str, Any] = {}
    if worker.image_pull_secrets:
        extras["imagePullSecrets"] = [r.dump() for r in worker.image_pull_secrets]
    if worker.service_account_name:
        extras["serviceAccountName"] = worker.service_account_name
    if worker.priority_class_name:
        extras["priorityClassName"] = worker.priority_class_name
    return extras


# What every rank's environment gets unless spec.worker.env says otherwise: one thread per CPU the
# rank asks for (torch and OpenMP would start one per core of the node, in every rank of the pod),
# and CUDA's device numbers in PCI order, as nvidia-smi and the device plugin count them.
DEVICE_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def rank_env(spec: ShardedModelSpec, held: list[RankPlan]) -> list[dict[str, str]]:
    """A rank pod's environment besides the worker's own (WorkerEnv): the thread count, on GPUs
    the device order and the NCCL policy (spec.worker.nccl: NVLS off unless asked), then the
    spec's env, which may replace the thread count and device order but not what the planner
    budgets (NCCL_NVLS_ENABLE) or another field sets."""
    user = {e.name for e in spec.worker.env}
    gpu = held[0].kind == "gpu"
    nccl = spec.worker.nccl.env() if gpu else {}
    clash = sorted((set(ENV_NAMES.values()) | set(spec.worker.nccl.env())) & user)
    if clash:
        raise SpecError(f"spec.worker.env: {', '.join(clash)} set by the operator for every rank (NCCL_* ones from "
                        f"spec.worker.nccl); remove {'it' if len(clash) == 1 else 'them'}")
    defaults = {"OMP_NUM_THREADS": str(resources.threads_per_rank(held[0], spec.worker.resources.requests)),
                **(DEVICE_ORDER if gpu else {})}
    return [*({"name": k, "value": v} for k, v in {**defaults, **nccl}.items() if k not in user),
            *({"name": e.name, "value": e.value} for e in spec.worker.env)]


ANY_RANK = RankPlan(replica=0, rank=0, stage=0, tp_rank=0, node="", device="", device_index=0, kind="gpu",
                     layers=(0, 0), embeds=True, has_lm_head=True, capacity_bytes=1, usable_bytes=1,
                     predicted_bytes={"weights": 0, "kv_cache": 0, "activations": 0, "overhead": 0})


def check_env(spec: ShardedModelSpec) -> None:
    """Raise SpecError for an environment no rank of either kind could be given."""
    for kind in ("gpu", "cpu"):
        rank_env(spec, [ANY_RANK.model_copy(update={"kind": kind})])
