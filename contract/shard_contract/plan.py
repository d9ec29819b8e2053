"""The Plan: the one contract between the control plane and the workers.

Torch-free and JSON-serialisable. The operator mounts it in every pod (ConfigMap), `shardctl`
hands it to local ranks, and each worker reads its own `RankPlan` from it: which layers, which TP
rank, which device, and how many bytes it is predicted to hold.

Ranks are numbered within a group with the tensor-parallel rank innermost:
`rank = stage * tensor_parallel + tp_rank` (as Megatron and vLLM do), so TP peers are adjacent.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .sharding import kv_whole_blocks
from .units import count

DEFAULT_PREFETCH = 2  # slots: one layer computes while the next loads (double buffering)


def describe_layers(layers: tuple[int, int] | list[int]) -> str:
    """A stage's decoder layers [start, stop) as every table and picture writes them: '0-7 (8
    layers)', '5 (1 layer)', 'none'."""
    start, stop = layers
    if stop <= start:
        return "none"
    return f"{start} (1 layer)" if stop - start == 1 else f"{start}-{stop - 1} ({count(stop - start, 'layer')})"


class PredictedBytes(BaseModel):
    weights: int = Field(description="Resident weights (an offloading rank's streamed layers are not).")
    kv_cache: int
    activations: int
    overhead: int
    staging: int = Field(0, description=(
        "An offloading rank's staging slots for streamed layers: what it copies of them (a CPU rank "
        "computes on the mapped checkpoint in place: 0, unless dtypes differ)."))
    total: int = 0

    def model_post_init(self, _context: object) -> None:
        self.total = self.weights + self.kv_cache + self.activations + self.overhead + self.staging


class OffloadSettings(BaseModel):
    """What the spec allows (`spec.placement.offload`), resolved. The plan keeps it, so that a spec
    that asks otherwise is planned again."""

    model_config = ConfigDict(frozen=True)

    policy: Literal["never", "auto", "always"] = "never"
    host_memory: int | None = Field(None, description="Bytes per rank for host-tier layers; None: no limit.")
    from_files: bool = True
    prefetch: int = Field(DEFAULT_PREFETCH, ge=1, description="Slots (layers in flight) per streaming rank.")


class OffloadPlan(BaseModel):
    """How a rank streams the decoder layers it does not hold: before each step needs one, the
    projection matrices of its slices come into one of `prefetch` slots (one layer each), the
    next ones while the current one computes: copied into staging on the device from host memory
    (GPU ranks: pinned) or from the checkpoint files, or (CPU ranks) mapped from the files, through
    the page cache, and computed on in place. Norms, biases, embeddings, the LM head, the KV cache
    and activations stay resident."""

    layers: list[int] = Field(description="Decoder layers whose projections stream (absolute indices).")
    file_layers: list[int] = Field(default_factory=list, description=(
        "Of those, the ones read from the checkpoint files; the others come from host memory."))
    prefetch: int = Field(ge=1, description="Slots: the layer computing and those loading ahead.")
    streamed_bytes: int = Field(description="Bytes of its slices streamed in per decode step.")
    copied_bytes: int = Field(0, description=(
        "Of those, the bytes copied into staging slots (a GPU rank's: all; a CPU rank computes on "
        "the mapped files in place and copies only tensors of another dtype or misaligned)."))
    read_bytes: int = Field(0, description=(
        "Bytes read from the files per decode step: a column slice is read with the rest of its rows."))
    host_bytes: int = Field(0, description=(
        "Host memory the streamed weights take: pinned copies (host tier) and the page cache of the "
        "ranges read (files)."))
    host_bandwidth: float = Field(0.0, description="Bytes/s of host-to-device copies (GPU ranks).")
    file_bandwidth: float = Field(0.0, description="Bytes/s of reads from the checkpoint files.")
    compute_seconds: float = Field(description="Decode step compute of the rank, streamed layers included.")
    stream_seconds: float = Field(description="Time to stream its layers once (every tier, one after another).")

    @property
    def tier(self) -> str:
        """host, files, or host+files."""
        if not self.file_layers:
            return "host"
        return "files" if len(self.file_layers) == len(self.layers) else "host+files"


class RankPlan(BaseModel):
    replica: int
    rank: int = Field(description="Rank within the group (torch.distributed RANK).")
    stage: int
    tp_rank: int
    node: str
    device: str = Field(description="cuda:N or cpu:N on that node.")
    device_index: int
    kind: Literal["gpu", "cpu"]
    product: str = ""
    layers: tuple[int, int] = Field(description="[start, stop) of the decoder layers.")
    embeds: bool = Field(description="Holds the token embeddings (first stage).")
    has_lm_head: bool = Field(description="Holds the final norm and LM head (last stage).")
    capacity_bytes: int
    usable_bytes: int = Field(description="capacity minus the headroom.")
    predicted_bytes: PredictedBytes
    offload: OffloadPlan | None = Field(None, description="The layers this rank streams; None: all resident.")
    kv_cache_tokens: int = Field(0, ge=0, description=(
        "Tokens of KV cache this rank holds for sequences (keys and values of its layers and KV heads "
        "for each), in whole blocks of sharding.KV_BLOCK_SIZE: the same on every rank of its group, the "
        "group's capacity. Its pool also holds sharding.KV_RESERVED_BLOCKS blocks no sequence uses "
        "(predicted_bytes.kv_cache counts them). 0 in a plan written before the field: maxBatchSize "
        "x maxModelLen (the Plan fills it in)."))

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


class StagePlan(BaseModel):
    stage: int
    layers: tuple[int, int]
    seconds_per_token: float = Field(description=(
        "Estimated decode time of this stage per token: max(compute, streaming) when it streams."))


class GroupPlan(BaseModel):
    replica: int
    stages: list[StagePlan]
    imbalance: float = Field(description="slowest stage / mean stage - 1; 0 is perfectly balanced.")
    critical_path_seconds: float = Field(description="Estimated time of one decode step through all stages.")


class Plan(BaseModel):
    model: str
    architecture: str
    profile_digest: str = ""
    dtype: str = Field(description="Runtime dtype of the weights, activations and KV cache.")
    quantization: Literal["none", "int8"] = Field("none", description=(
        "int8: the decoder layers' projection weights are int8 with one float32 scale per output "
        "row (weight-only); embeddings, norms and the LM head stay in dtype."))
    offload: OffloadSettings = Field(default_factory=OffloadSettings)
    num_layers: int
    tensor_parallel: int
    pipeline_parallel: int
    replicas: int
    max_model_len: int
    max_batch_size: int
    max_batch_size_chosen: bool = Field(False, description=(
        "spec.model.maxBatchSize was left out on GPUs and the planner chose max_batch_size: the "
        "largest power of two up to 256 whose running rows leave each rank's KV cache room for a "
        "maxModelLen sequence (any such cap still honours the spec)."))
    memory_headroom: float
    nvls: bool = Field(False, description="NCCL's NVLS buffers are budgeted in each GPU rank's overhead "
                                          "(the spec turned NVLS on).")
    kv_cache_memory_fraction: float | None = Field(None, description=(
        "spec.serving.kvCacheMemoryFraction as asked (None: the default of each kind of device), "
        "kept so that a spec that asks otherwise is planned again."))
    kv_cache_memory: int | None = Field(None, description="spec.serving.kvCacheMemory in bytes, as asked.")
    groups: list[GroupPlan]
    ranks: list[RankPlan]
    reason: str = Field("", description="Why this TP x PP was chosen (and max_batch_size, when the planner chose it "
                                        "below the default).")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    def model_post_init(self, _context: object) -> None:
        # a plan written before ranks carried their KV tokens reserved maxBatchSize x maxModelLen
        for r in self.ranks:
            if r.kv_cache_tokens == 0:
                r.kv_cache_tokens = self.reserved_tokens

    @property
    def reserved_tokens(self) -> int:
        """maxBatchSize sequences of maxModelLen tokens, each in whole KV blocks: a cache that holds
        every running sequence at its longest."""
        return self.max_batch_size * kv_whole_blocks(self.max_model_len)

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens of KV cache every group holds at least (each rank's `kv_cache_tokens`; they differ
        between groups only on devices of different sizes): the prompts and generated tokens of its
        sequences that fit at once."""
        return min((r.kv_cache_tokens for r in self.ranks), default=self.reserved_tokens)

    def group_kv_cache_tokens(self, replica: int) -> int:
        """Tokens of KV cache one group holds (its ranks hold the same)."""
        return min((r.kv_cache_tokens for r in self.group(replica)), default=self.reserved_tokens)

    @property
    def stages(self) -> list[StagePlan]:
        return self.groups[0].stages if self.groups else []

    @property
    def imbalance(self) -> float:
        return max((g.imbalance for g in self.groups), default=0.0)

    @property
    def streams(self) -> bool:
        """Some rank streams layers (offload)."""
        return any(r.offload is not None for r in self.ranks)

    def group(self, replica: int) -> list[RankPlan]:
        return [r for r in self.ranks if r.replica == replica]

    def rank_plan(self, replica: int, rank: int) -> RankPlan:
        for r in self.ranks:
            if r.replica == replica and r.rank == rank:
                return r
        raise KeyError(f"plan has no rank {rank} in replica {replica}")

    def group_hash(self, replica: int) -> str:
        """Identity of one group's placement: changes exactly when its pods must be replaced."""
        # the KV tokens only when they are not the reservation every plan before them made, so
        # that those groups keep their identity (and are not restarted by an upgrade)
        placement = [(r.rank, r.node, r.device, r.layers, r.tp_rank, r.stage)
                     + ((r.offload.layers, r.offload.file_layers, r.offload.prefetch) if r.offload else ())
                     + ((r.kv_cache_tokens,) if r.kv_cache_tokens != self.reserved_tokens else ())
                     for r in self.group(replica)]
        key = json.dumps([self.model, self.profile_digest, self.dtype, self.quantization, self.tensor_parallel,
                          self.pipeline_parallel, self.max_model_len, self.max_batch_size, placement])
        return hashlib.sha256(key.encode()).hexdigest()[:10]

    @property
    def hash(self) -> str:
        return hashlib.sha256("".join(self.group_hash(g.replica) for g in self.groups).encode()).hexdigest()[:10]

    def to_json_dict(self) -> dict[str, Any]:
        """The documented JSON form (docs/planner.md)."""
        data = self.model_dump(mode="json")
        data["stages"] = [s.model_dump(mode="json") for s in self.stages]
        data["imbalance"] = self.imbalance
        data["hash"] = self.hash
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.model_validate_json(text)
