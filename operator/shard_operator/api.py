"""The ShardedModel API (`sharding.dev/v1alpha1`): spec and status as pydantic models.

These models are the single source of the CRD (`crd.py` generates `crds/shardedmodels.yaml` from
them) and of validation messages. Field names are the Kubernetes ones (camelCase) on the wire and
snake_case in Python.
"""

from __future__ import annotations

import difflib
import os
import posixpath
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from shard_contract.units import parse_bytes

GROUP = "sharding.dev"
VERSION = "v1alpha1"
API_VERSION: Final = "sharding.dev/v1alpha1"  # f"{GROUP}/{VERSION}", spelled out for its type
KIND: Final = "ShardedModel"
PLURAL = "shardedmodels"
SINGULAR = "shardedmodel"
SHORT_NAMES = ["sm"]

PHASES = ("Pending", "Planning", "Loading", "Ready", "Rebalancing", "Degraded", "Failed")
Phase = Literal["Pending", "Planning", "Loading", "Ready", "Rebalancing", "Degraded", "Failed"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["none", "int8"]
Auto = Literal["auto"]
# Kubernetes int-or-string: a positive integer, or "auto" to let the planner choose.
Degree = Annotated[int, Field(ge=1)] | Auto
# A path without ".." segments, as the CRD's `pattern` (RE2: no lookahead): every segment is
# anything but "..". Kubernetes refuses ".." in a hostPath for the same reason.
_SEGMENT = r"([.]?[^/.][^/]*|[.]|[.][.][^/]+)?"
NO_DOTDOT = rf"^{_SEGMENT}(/{_SEGMENT})*$"


class ApiModel(BaseModel):
    """Kubernetes conventions: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              validate_default=True)

    def dump(self) -> dict[str, Any]:
        """The wire form: camelCase keys, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# ---------------------------------------------------------------- spec
class PvcSource(ApiModel):
    claim_name: str = Field(min_length=1, description="Name of a PersistentVolumeClaim in the model's namespace.")


class HostPathSource(ApiModel):
    path: str = Field(min_length=1, description="Directory on every node of the pool: absolute, no '..'.",
                      json_schema_extra={"pattern": NO_DOTDOT.replace("^", "^/", 1)})

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"must be an absolute path without '..' segments (got {path!r})")
        return _normal(path)


class ImageSource(ApiModel):
    reference: str = Field(min_length=1, description="OCI image holding the model files (image volume).")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class ModelVolume(ApiModel):
    """Where the checkpoint lives. Exactly one source; mounted read-only at /models in workers."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "[has(self.pvc), has(self.hostPath), has(self.image)].filter(x, x).size() == 1",
        "message": "give exactly one of pvc, hostPath or image"}]})

    pvc: PvcSource | None = None
    host_path: HostPathSource | None = None
    image: ImageSource | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelVolume:
        given = [name for name in ("pvc", "hostPath", "image")
                 if getattr(self, to_snake(name)) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of pvc, hostPath or image (got {given or 'none'})")
        return self


class ModelSpec(ApiModel):
    volume: ModelVolume | None = None  # before `path`, whose check depends on it
    path: str = Field(min_length=1, json_schema_extra={"pattern": NO_DOTDOT}, description=(
        "Model directory (config.json + safetensors). With a volume: a path inside it, relative "
        "to its root (a leading / is that root), without '..' segments. Without one: an absolute "
        "path on the node, or for `shardctl` a path relative to the YAML file (which alone may "
        "use '..')."))

    @field_validator("path")
    @classmethod
    def _inside_volume(cls, path: str, info: ValidationInfo) -> str:
        in_volume = info.data.get("volume") is not None
        if ".." in path.split("/"):
            if in_volume:
                raise ValueError(f"must stay inside the volume: no '..' segments (got {path!r})")
            if path.startswith("/"):
                raise ValueError(f"a path on the node must not have '..' segments (got {path!r})")
        return (_normal(path).lstrip("/") or ".") if in_volume else _normal(path)
    dtype: Dtype = Field("auto", description="Runtime dtype; auto keeps the checkpoint's.")
    quantization: Quantization = Field("none", description=(
        "Weight-only quantization at load: int8 stores the decoder layers' projections as int8 with "
        "one scale per output row (about half of bfloat16's bytes); embeddings, norms and the LM "
        "head stay in dtype, and so do activations."))
    max_model_len: int | None = Field(None, ge=1, description=(
        "Longest sequence (prompt + generated) served; sizes the KV cache. Default: the model's "
        "max_position_embeddings, at most 4096."))
    max_batch_size: int = Field(1, ge=1, description="Sequences decoded together; sizes the KV cache.")


class Parallelism(ApiModel):
    tensor: Degree = Field("auto", description="Tensor-parallel degree, or auto.")
    pipeline: Degree = Field("auto", description="Pipeline stages, or auto.")
    layer_partition: list[Annotated[int, Field(ge=1)]] | None = Field(None, description=(
        "Decoder layers per pipeline stage, first to last. Checked against memory, not trusted."))

    @model_validator(mode="after")
    def _partition_matches_pipeline(self) -> Parallelism:
        if self.layer_partition is not None and isinstance(self.pipeline, int) \
                and len(self.layer_partition) != self.pipeline:
            raise ValueError(f"layerPartition has {len(self.layer_partition)} stages but "
                             f"pipeline is {self.pipeline}")
        return self


class Toleration(ApiModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Topology(ApiModel):
    spread_replicas: bool = Field(True, description="Prefer different nodes for different replicas.")


class Offload(ApiModel):
    """Streaming the decoder layers that do not fit the devices as each step needs them (docs/planner.md)."""

    policy: Literal["never", "auto", "always"] = Field("never", description=(
        "never: every layer resident, or InsufficientCapacity. auto: stream the layers that do not "
        "fit, only when the model does not fit otherwise. always: stream every decoder layer (the "
        "smallest device footprint)."))
    host_memory: str | None = Field(None, description=(
        "Host memory per rank for the streamed weights of GPU ranks (pinned copies), a quantity "
        "such as 64Gi; unset: as much as they need (the pods request it). What does not fit is read "
        "from the files, when fromFiles allows."),
        json_schema_extra={"pattern": r"^[0-9]*[.]?[0-9]+([kKmMgGtT][iI]?)?[bB]?$"})
    from_files: bool = Field(True, description=(
        "The checkpoint files may serve as the slowest tier, read on demand through the page cache "
        "(the only tier of CPU ranks, whose device memory is host memory)."))
    prefetch: Degree = Field("auto", description=(
        "Staging slots per rank, each one layer: the layer computing and those loading ahead. auto: "
        "2 (double buffering)."))

    @field_validator("host_memory")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None:
            parse_bytes(value)  # raises with what to write
        return value

    @property
    def host_memory_bytes(self) -> int | None:
        return None if self.host_memory is None else parse_bytes(self.host_memory)


class Placement(ApiModel):
    node_selector: dict[str, str] = Field(default_factory=dict, description="Labels that define the node pool.")
    tolerations: list[Toleration] = Field(default_factory=list)
    gpu_resource: str = Field("nvidia.com/gpu", min_length=1, description="Extended resource of one GPU.")
    memory_headroom: float = Field(0.1, ge=0.0, lt=1.0, description=(
        "Fraction of every device's memory kept free (allocator fragmentation, spikes)."))
    topology: Topology = Field(default_factory=Topology)
    pod_layout: Literal["auto", "perRank", "perTensorGroup"] = Field("auto", description=(
        "perRank: one pod per rank (one GPU each). perTensorGroup: one pod per tensor-parallel group "
        "(a pipeline stage, on one node) holding its GPUs and running one rank process per GPU, so NCCL "
        "can use NVLink between them (it cannot across pods). auto: perTensorGroup on GPUs at tensor > 1, "
        "else perRank."))
    offload: Offload = Field(default_factory=Offload)

    @property
    def pod_tolerations(self) -> list[Toleration]:
        """What the rank pods tolerate: the spec's tolerations and the GPU resource's own taint
        (`nvidia.com/gpu:NoSchedule` on managed GPU pools), which Kubernetes' ExtendedResourceToleration
        admission plugin would add to any pod that requests the resource. Other taints need the spec."""
        own = Toleration(key=self.gpu_resource, operator="Exists", effect="NoSchedule")
        return [*self.tolerations, own] if own not in self.tolerations else list(self.tolerations)


class Rollout(ApiModel):
    max_surge: int = Field(1, ge=0, description="Extra groups allowed during a rebalance.")
    max_unavailable: int = Field(0, ge=0, description="Groups that may be down during a rebalance.")


class EnvVar(ApiModel):
    name: str = Field(min_length=1)
    value: str = ""


class Resources(ApiModel):
    requests: dict[str, str] = Field(default_factory=dict)
    limits: dict[str, str] = Field(default_factory=dict)

    @field_validator("requests", "limits", mode="before")
    @classmethod
    def _quantities_as_strings(cls, value: Any) -> Any:
        # Kubernetes quantities are int-or-string; keep them as the strings Kubernetes prints.
        if isinstance(value, dict):
            return {k: str(v) for k, v in value.items()}
        return value


class SecretKeyRef(ApiModel):
    name: str = Field(max_length=253, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                      description="A Secret in the model's namespace.")
    key: str = Field(max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="The Secret's key that holds it.")


DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A label or annotation key: an optional DNS-subdomain prefix and "/", then a name of at most 63.
QUALIFIED_NAME = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
OURS = ("sharding.dev/", "app.kubernetes.io/managed-by")  # the operator's own labels and annotations
_NOT_OURS: dict[str, Any] = {  # Any: json_schema_extra's JSON values (a dict[str, str] is not one to mypy)
    "rule": "self.all(k, !k.startsWith('sharding.dev/') && k != 'app.kubernetes.io/managed-by')",
    "message": "sharding.dev/ keys and app.kubernetes.io/managed-by are the operator's"}
# An interface list as NCCL reads NCCL_SOCKET_IFNAME and NCCL_IB_HCA: "^" excludes, "=" matches exactly.
NCCL_LIST = r"^[=^]?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$"


class LocalObjectReference(ApiModel):
    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN, description="A Secret in the model's namespace.")


class Nccl(ApiModel):
    """NCCL settings of GPU ranks, written into their environment (other NCCL_* variables: env)."""

    nvls: bool = Field(False, description=(
        "NVLink SHARP (NCCL_NVLS_ENABLE) on NVSwitch systems. Off by default: its buffers take about 0.3 GiB "
        "per rank per communicator; on, the planner budgets them."))
    socket_ifname: str | None = Field(None, max_length=256, pattern=NCCL_LIST, description=(
        "NCCL_SOCKET_IFNAME: the interfaces NCCL's sockets use (e.g. eth0; ^lo,docker excludes)."))
    ib_hca: str | None = Field(None, max_length=256, pattern=NCCL_LIST, description=(
        "NCCL_IB_HCA: the InfiniBand/RoCE adapters NCCL uses (e.g. mlx5_0,mlx5_1; =mlx5_0 exactly)."))
    debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = Field(None, description="NCCL_DEBUG.")

    def env(self) -> dict[str, str]:
        values = {"NCCL_NVLS_ENABLE": "1" if self.nvls else "0", "NCCL_SOCKET_IFNAME": self.socket_ifname,
                  "NCCL_IB_HCA": self.ib_hca, "NCCL_DEBUG": self.debug}
        return {k: v for k, v in values.items() if v is not None}


class WorkerSpec(ApiModel):
    image: str | None = Field(None, description="Worker image; default: the operator's setting.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    resources: Resources = Field(default_factory=Resources, description=(
        "CPU/memory for each rank, over defaults sized from the plan; a pod of several ranks asks for "
        "their sum, and the GPUs are added."))
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment, e.g. NCCL_SOCKET_IFNAME.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the API and /metrics.")
    rendezvous_port: int = Field(29500, ge=1, le=65535, description="torch.distributed MASTER_PORT.")
    rendezvous_timeout_seconds: int = Field(600, ge=1)
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: NCCL on GPUs, gloo on CPUs.")
    api_key_secret: SecretKeyRef | None = Field(
        None, description="An API key the OpenAI routes require (Authorization: Bearer): mounted from this Secret "
                          "into each group's leader pod, which the operator never reads. Health, readiness, "
                          "metrics and /v1/shards stay open.")
    runtime_class_name: str | None = Field(None, min_length=1, description=(
        "RuntimeClass of the rank pods, e.g. nvidia where the NVIDIA container runtime is not the nodes' "
        "default (the GPU Operator installs one by that name)."))
    # What a cluster admin sets on every rank pod (the profiling pod gets the pull secrets,
    # service account, priority and labels too: it runs the same image on the same nodes).
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16, description=(
        "Secrets (kubernetes.io/dockerconfigjson) the rank pods pull the worker image with: a private registry."))
    service_account_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN, description=(
        "ServiceAccount of the rank pods (workload identity, image pulls); its API token is never mounted: "
        "the workers do not call the Kubernetes API. Default: the namespace's default account."))
    # Keys are checked here (`_keys`), not by the CRD: Kubernetes schemas have no patternProperties,
    # and a regex per key in CEL may exceed the API server's cost budget; the pod's own validation
    # would refuse them too.
    pod_annotations: dict[str, str] = Field(
        default_factory=dict, json_schema_extra={"x-kubernetes-validations": [_NOT_OURS], "maxProperties": 64},
        description=(
            "Annotations of the rank pods, e.g. k8s.v1.cni.cncf.io/networks for a Multus (RDMA) network, "
            "sidecar.istio.io/inject: \"false\"."))
    pod_labels: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]] = Field(
        default_factory=dict, json_schema_extra={"x-kubernetes-validations": [_NOT_OURS], "maxProperties": 64},
        description=(
            "Labels of the rank pods (cost allocation, policies); sharding.dev/ keys are the operator's."))
    priority_class_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN, description=(
        "PriorityClass of the rank pods: what the scheduler may preempt for them, and they for others."))
    host_network: bool = Field(False, description=(
        "Run the rank pods in the node's network namespace (RDMA or NICs that pods cannot reach otherwise). "
        "Their ports are then the node's: each pod serves on port + its first rank, so one group's pods "
        "share a node without a clash; NetworkPolicies do not apply."))
    capabilities: list[Literal["IPC_LOCK"]] = Field(default_factory=list, max_length=1, description=(
        "Linux capabilities added to the worker container (all others are dropped): IPC_LOCK, as RDMA "
        "device plugins ask, to pin memory for InfiniBand/RoCE."))
    nccl: Nccl = Field(default_factory=Nccl, description="NCCL settings of GPU ranks.")

    @field_validator("pod_annotations", "pod_labels")
    @classmethod
    def _keys(cls, values: dict[str, str]) -> dict[str, str]:
        bad = sorted(k for k in values if len(k) > 317 or not re.match(QUALIFIED_NAME, k))
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))}: not a label or annotation key (a name of at most 63 "
                             "letters, digits, '-', '_' or '.', after an optional DNS-subdomain prefix and '/')")
        ours = sorted(k for k in values if k.startswith(OURS))
        if ours:
            raise ValueError(f"{', '.join(ours)}: sharding.dev/ keys and app.kubernetes.io/managed-by are the "
                             "operator's")
        return values


class ShardedModelSpec(ApiModel):
    model: ModelSpec
    parallelism: Parallelism = Field(default_factory=Parallelism)
    replicas: int = Field(1, ge=0, description="Data-parallel copies of the whole sharded group.")
    placement: Placement = Field(default_factory=Placement)
    rollout: Rollout = Field(default_factory=Rollout)
    worker: WorkerSpec = Field(default_factory=WorkerSpec)

    @model_validator(mode="after")
    def _offload_streams_checkpoint_weights(self) -> ShardedModelSpec:
        if self.placement.offload.policy == "always" and self.model.quantization == "int8":
            raise ValueError(OFFLOAD_INT8)
        return self


# Streaming reads the checkpoint's own weights at every step: int8 ones would be quantized again
# at every step, from more bytes than bfloat16's, which is slower than streaming bfloat16.
OFFLOAD_INT8 = ("placement.offload.policy always cannot stream int8 weights (spec.model.quantization int8): "
                "streamed layers are read from the checkpoint at every step and would be quantized again "
                "each time; use quantization none with offload, or int8 without it")


# ---------------------------------------------------------------- status
class StageStatus(ApiModel):
    stage: int
    layers: list[int] = Field(description="[start, stop) of the decoder layers of this stage.")


class PlanSummary(ApiModel):
    tensor_parallel: int
    pipeline_parallel: int
    quantization: Quantization = "none"
    stages: list[StageStatus] = Field(default_factory=list)
    imbalance: float = 0.0
    hash: str = ""
    reason: str = ""
    max_predicted_bytes: int = 0
    predicted_step_seconds: float = Field(0.0, description="Estimated time of one decode step (the slowest "
                                                           "group's critical path through every stage).")


class ShardOffload(ApiModel):
    """What a rank streams (offload): from its plan, and what it measured since it started."""

    layers: list[int] = Field(description="The decoder layers whose projections it streams.")
    tier: str = Field(description="Where they come from: host (memory), files, or host+files.")
    bytes_per_step: int = Field(description="Bytes it streams per decode step (the plan's).")
    step_seconds: float = Field(description="The plan's decode step of this rank: max(compute, streaming).")
    streamed_bytes: int | None = Field(None, description="Bytes streamed so far (measured).")
    stream_seconds: float | None = Field(None, description="Seconds spent streaming so far (measured).")
    stall_seconds: float | None = Field(None, description="Seconds a forward pass waited for a layer (measured; "
                                                          "on a GPU the host's wait for the prefetch thread).")
    device_stall_seconds: float | None = Field(None, description="GPU: seconds the compute stream waited for a "
                                                                 "layer's copy (measured).")


class ShardStatus(ApiModel):
    group: int
    rank: int
    pod: str
    node: str = ""
    device: str = ""
    stage: int = 0
    tp_rank: int = 0
    layers: list[int] = Field(default_factory=list)
    predicted_bytes: int = 0
    quantization: Quantization = Field("none", description="How this shard's weights are stored (from its plan).")
    resident_bytes: int | None = None
    offload: ShardOffload | None = None
    state: str = "Pending"


class Condition(ApiModel):
    type: Literal["Available", "Progressing", "Degraded"]
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class GroupStatus(ApiModel):
    """One data-parallel group (a replica's set of ranks) as the operator sees it."""

    replica: int
    revision: str = Field(description="Identity of the group's pods: its placement and pod template.")
    plan_hash: str = Field("", description="Plan.group_hash of the group's placement.")
    state: str = Field("Pending", description="Starting, Ready, Failed, Lost, Terminating or Empty.")
    ready_ranks: int = 0
    ranks: int = 0
    restarts: int = Field(0, description="Times the operator recreated this revision after a rank failed.")
    message: str = ""


class ShardedModelStatus(ApiModel):
    phase: Phase = "Pending"
    observed_generation: int | None = None
    replicas: int = 0
    ready_replicas: int = 0
    selector: str = Field("", description="Label selector of the leader pods (scale subresource).")
    ready: str = Field("", description="Ready groups of the replicas wanted, as kubectl shows it (1/2).")
    url: str = Field("", description="Where the model serves inside the cluster: its endpoint Service.")
    reason: str = Field("", description="Why the model is Failed or Degraded (the Degraded condition's reason).")
    plan: PlanSummary | None = None
    shards: list[ShardStatus] = Field(default_factory=list)
    groups: list[GroupStatus] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list)


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    namespace: str | None = None


class ShardedModel(ApiModel):
    api_version: Literal["sharding.dev/v1alpha1"] = API_VERSION
    kind: Literal["ShardedModel"] = KIND
    metadata: ObjectMeta
    spec: ShardedModelSpec
    status: ShardedModelStatus | None = None


# ---------------------------------------------------------------- helpers
def to_snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


class SpecError(ValueError):
    """A ShardedModel that cannot be accepted; the message names every offending field."""


def _field_path(loc: tuple[Any, ...], root: str) -> str:
    # pydantic adds union members to the location ("constrained-int", "literal['auto']"): drop them.
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("constrained-")
                                                                   or p in ("int", "str", "float")))]
    return ".".join(p for p in [root, *parts] if p)


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The wire names of the fields beside the one at `loc` (its parent model's), or [] where the
    location leaves the models (a dict, a list of scalars)."""
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        info = next((f for name, f in model.model_fields.items() if part in (name, f.alias)), None)
        if info is None:
            return []
        inner = [a for a in (typing.get_args(info.annotation) or (info.annotation,))
                 for a in (typing.get_args(a) or (a,))]
        nested = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nested is None:
            return []
        model = nested
    return [f.alias or name for name, f in model.model_fields.items()]


def _did_you_mean(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    close = difflib.get_close_matches(str(loc[-1]), _fields_at(model, loc), n=1, cutoff=0.6)
    if not close:  # often only the case is off: maxmodellen
        close = [f for f in _fields_at(model, loc) if f.lower() == str(loc[-1]).lower()][:1]
    return f"did you mean {close[0]}?" if close else "check its spelling and indentation"


def explain(err: ValidationError, root: str = "", model: type[BaseModel] | None = None) -> str:
    """One line per offending field, named as a Kubernetes user writes it; an unknown field gets
    the nearest field `model` has there ("did you mean maxModelLen?")."""
    lines: dict[str, str] = {}
    for error in err.errors():
        path = _field_path(error["loc"], root)
        given = error.get("input")
        if any(isinstance(p, str) and p == "literal['auto']" for p in error["loc"]):
            lines[path] = f"{path}: must be a positive integer or \"auto\" (got {given!r})"
        elif error["type"] == "extra_forbidden":
            hint = _did_you_mean(model, error["loc"]) if model else "check its spelling and indentation"
            lines[path] = f"{path}: unknown field ({hint})"
        elif error["type"] == "missing":
            lines[path] = f"{path}: required"
        elif error["type"] == "value_error":
            lines.setdefault(path, f"{path or 'spec'}: {error['msg'].removeprefix('Value error, ')}")
        else:
            message = error["msg"].removeprefix("Input should be ").removeprefix("Value error, ")
            lines.setdefault(path, f"{path}: should be {message} (got {given!r})")
    return "\n".join(lines.values())


def parse_sharded_model(obj: dict[str, Any]) -> ShardedModel:
    """Validate a whole ShardedModel object (as read from YAML or the API)."""
    if not isinstance(obj, dict):
        raise SpecError(f"expected a ShardedModel object, got {type(obj).__name__}")
    try:
        return ShardedModel.model_validate(obj)
    except ValidationError as err:
        name = (obj.get("metadata") or {}).get("name", "?") if isinstance(obj.get("metadata"), dict) else "?"
        raise SpecError(f"ShardedModel {name} is invalid:\n{explain(err, model=ShardedModel)}") from None


def parse_spec(spec: dict[str, Any]) -> ShardedModelSpec:
    """Validate just the spec (what the operator receives)."""
    try:
        return ShardedModelSpec.model_validate(spec or {})
    except ValidationError as err:
        raise SpecError(explain(err, root="spec", model=ShardedModelSpec)) from None


def load_sharded_models(path: str | os.PathLike[str]) -> list[ShardedModel]:
    """Every ShardedModel in a YAML file (other kinds in a multi-document file are skipped)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except OSError as err:
        raise SpecError(f"{path}: cannot read it ({err.strerror})") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d]
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {err}") from None
    models = [parse_sharded_model(d) for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if not models:
        raise SpecError(f"{path}: no object of kind {KIND} found")
    return models


def _normal(path: str) -> str:
    """`path` without "." segments, doubled or trailing slashes (POSIX keeps a leading "//")."""
    normal = posixpath.normpath(path)
    return "/" + normal.lstrip("/") if normal.startswith("/") else normal


def inside(root: Path, path: str, field: str = "spec.model.path", within: str = "the volume") -> Path:
    """`root / path` with symlinks resolved, when it stays inside `root` (resolved too).

    The message says only that `field` must stay inside: it does not tell whether anything outside
    exists (nothing outside is named, and the answer does not depend on it)."""
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(real_root / path))
    if not real.is_relative_to(real_root):
        raise SpecError(f"{field} must stay inside {within}")
    return real


def resolve_model_dir(model: ModelSpec, base: str | os.PathLike[str] | None = None) -> Path:
    """The local directory of the model, when it can be known without a cluster.

    A PVC or an image is out of reach, so the directory of the YAML file (`base`) stands for its
    root: a spec that names a volume is planned from a local copy kept at the same path beside it.
    """
    if model.volume is not None and model.volume.host_path is not None:
        return inside(Path(model.volume.host_path.path), model.path)
    if model.volume is not None:
        local = Path(base) / model.path if base is not None else None
        if local is None or not local.is_dir():
            kind = "a PVC" if model.volume.pvc is not None else "an image"
            where = f" (no {local})" if local is not None else ""
            raise SpecError(f"spec.model.volume is {kind}: pass --model-dir with a local copy of the model "
                            f"(its config.json is enough to plan), or keep one at spec.model.path beside the "
                            f"YAML file{where}")
        return local
    path = Path(model.path)
    return path if path.is_absolute() or base is None else Path(base) / path
