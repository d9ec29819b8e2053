"""`status`: the phase, the plan's summary, every shard and group, and the conditions."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import ApiModel, Phase, Quantization


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
    kv_cache_tokens: int = Field(0, description=(
        "Tokens of KV cache every group holds at least (the smallest group's; each shard says its "
        "own): what its sequences' prompts and generated tokens may take at once, sized by "
        "spec.serving from the memory the plan leaves free."))


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
    kv_cache_tokens: int = Field(0, description="Tokens of KV cache this shard's group holds (the plan's: "
                                                "every rank of a group holds the same tokens).")
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
