"""`spec.parallelism`, `spec.placement` (the node pool, headroom, topology, pod layout, offload)
and `spec.rollout`: where and how the ranks run."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from shard_contract.units import parse_bytes

from .base import ApiModel, Degree


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
