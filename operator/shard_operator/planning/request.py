"""What a plan is asked for: the spec resolved against the profile (`Request`), the planner's
settable constants (`PlannerOptions`), and how it refuses (`PlanError`). Pure."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from shard_contract.plan import DEFAULT_PREFETCH, OffloadSettings
from shard_contract.sharding import tp_problem, valid_tensor_degrees

from ..api import ShardedModelSpec
from .advice import Suggestion
from .inventory import Device, Inventory
from .profile import ModelProfile
from .sizing import RUNTIME_OVERHEAD
from .step import StepOverhead
from .transport import Transport

DEFAULT_MAX_MODEL_LEN = 4096
# The most sequences running at once when the spec leaves maxBatchSize out. A GPU's KV cache holds
# what its free memory allows and the cap bounds the rows that decode together (vLLM's default
# max_num_seqs); what those rows cost beyond the KV (captured decode steps, the sampler, block
# masks) the planner counts (sizing.running_bytes, sizing.mask_bytes), and where 256 of them leave
# no room for one sequence's KV it takes a smaller power of two (rowcap.py). A CPU's cache is
# reserved for maxBatchSize whole sequences unless spec.serving says otherwise, so its default
# stays one.
DEFAULT_MAX_BATCH = {"gpu": 256, "cpu": 1}
# `dtype: auto` of a bfloat16 checkpoint on GPUs without native bfloat16 (compute capability < 8.0)
AUTO_FALLBACK = {"bfloat16": "float16"}


@dataclass(frozen=True)
class Shortfall:
    """What one replica that fits nowhere needs, against what the pool offers (for its picture)."""

    weights: int  # one replica's, at the runtime dtype
    kv_cache: int  # one replica's
    per_device: int  # runtime overhead and activations, on every device
    devices: tuple[Device, ...]
    usable: tuple[int, ...]  # each device's memory below the headroom

    @property
    def need(self) -> int:
        return self.weights + self.kv_cache + len(self.usable) * self.per_device


class PlanError(ValueError):
    """No layout fits. `reason` is a condition reason; the message says what would help; a
    `shortfall` says it in numbers when the pool is too small, and `suggestions` are the changes
    the message offers, each checked by planning again."""

    def __init__(self, reason: str, message: str, shortfall: Shortfall | None = None,
                 suggestions: list[Suggestion] | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.shortfall = shortfall
        self.suggestions = suggestions or []


@dataclass(frozen=True)
class PlannerOptions:
    runtime_overhead: dict[str, int] = field(default_factory=lambda: dict(RUNTIME_OVERHEAD))
    tolerance: float = 0.10  # critical paths this close count as equal; fewer devices wins
    transport: Transport = field(default_factory=Transport)  # seconds per collective and hop
    step: StepOverhead = field(default_factory=StepOverhead)  # a step's costs beyond reads and collectives

    @classmethod
    def from_json(cls, text: str) -> PlannerOptions:
        """The defaults with what a JSON object changes, key by key, e.g.
        {"runtime_overhead": {"gpu": 3221225472}, "transport": {"collective_across_pods": {"gpu": 2e-4}}}."""
        def merged(default: Any, given: Any, where: str) -> Any:
            if not isinstance(default, dict):
                return given
            if not isinstance(given, dict) or set(given) - set(default):
                raise ValueError(f"planner options: {where or 'the options'} takes an object with keys "
                                 f"{', '.join(sorted(default))} (got {json.dumps(given)})")
            return {k: merged(v, given.get(k, v), f"{where}.{k}".lstrip(".")) for k, v in default.items()}
        try:
            values = merged(asdict(cls()), json.loads(text or "{}"), "")
            values["transport"] = Transport(**values["transport"])
            values["step"] = StepOverhead(**values["step"])
            return TypeAdapter(cls).validate_python(values)
        except (json.JSONDecodeError, ValidationError) as err:
            raise ValueError(f"planner options: {err}") from None


@dataclass(frozen=True)
class Request:
    """What the spec asks for, resolved against the profile."""

    dtype: str
    quantization: str
    max_len: int
    batch: int
    replicas: int
    headroom: float
    spread_replicas: bool
    pod_layout: str = "auto"
    offload: OffloadSettings = OffloadSettings()
    nvls: bool = False  # spec.worker.nccl.nvls: NCCL's NVLS buffers are budgeted
    kv_fraction: float | None = None  # spec.serving.kvCacheMemoryFraction
    kv_bytes: int | None = None  # spec.serving.kvCacheMemory
    # maxBatchSize unset on GPUs: `batch` is the most the planner may choose, and it chooses (rowcap.py)
    rows_chosen: bool = False


def pool_kind(inventory: Inventory) -> str:
    """The kind of device an unset maxBatchSize is resolved for: gpu when the pool has any."""
    return "gpu" if any(d.kind == "gpu" for d in inventory.devices) else "cpu"


def resolve_request(profile: ModelProfile, spec: ShardedModelSpec, kind: str = "gpu") -> Request:
    """What the spec asks for in numbers: dtype `auto` and an unset maxModelLen resolved against
    the profile, an unset maxBatchSize by the kind of device it runs on (`kind`: gpu when the
    pool has any; on GPUs the most the planner may choose); a PlanError (InvalidSpec) for a length
    the model cannot take."""
    dtype = profile.dtype if spec.model.dtype == "auto" else spec.model.dtype
    max_len = spec.model.max_model_len or min(profile.shape.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if max_len > profile.shape.max_position_embeddings:
        raise PlanError("InvalidSpec", f"spec.model.maxModelLen {max_len} exceeds the model's "
                        f"max_position_embeddings {profile.shape.max_position_embeddings}")
    off = spec.placement.offload
    return Request(dtype=dtype, quantization=spec.model.quantization, max_len=max_len,
                   batch=spec.model.max_batch_size or DEFAULT_MAX_BATCH[kind],
                   rows_chosen=spec.model.max_batch_size is None and kind == "gpu",
                   kv_fraction=spec.serving.kv_cache_memory_fraction, kv_bytes=spec.serving.kv_cache_bytes,
                   replicas=spec.replicas, headroom=spec.placement.memory_headroom,
                   spread_replicas=spec.placement.topology.spread_replicas, pod_layout=spec.placement.pod_layout,
                   nvls=spec.worker.nccl.nvls,
                   offload=OffloadSettings(policy=off.policy, host_memory=off.host_memory_bytes,
                                           from_files=off.from_files,
                                           prefetch=DEFAULT_PREFETCH if off.prefetch == "auto" else off.prefetch))


def check_parallelism(profile: ModelProfile, spec: ShardedModelSpec) -> None:
    """Raise InvalidParallelism for degrees this model can never run, whatever the pool."""
    par = spec.parallelism
    if par.tensor != "auto" and (problem := tp_problem(profile.shape, par.tensor)):
        valid = ", ".join(map(str, valid_tensor_degrees(profile.shape, profile.shape.num_heads)))
        raise PlanError("InvalidParallelism", f"spec.parallelism.tensor: {problem}; valid: {valid}")
    if par.pipeline != "auto" and par.pipeline > profile.shape.num_layers:
        raise PlanError("InvalidParallelism", f"spec.parallelism.pipeline={par.pipeline} exceeds the "
                        f"{profile.shape.num_layers} decoder layers; valid: 1 to {profile.shape.num_layers}")
    if par.layer_partition is not None and sum(par.layer_partition) != profile.shape.num_layers:
        raise PlanError("InvalidParallelism", f"spec.parallelism.layerPartition {par.layer_partition} places "
                        f"{sum(par.layer_partition)} layers; the model has {profile.shape.num_layers}")
