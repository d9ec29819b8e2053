"""`spec.serving`: how much memory the KV cache takes on each rank.

The KV cache is sized from what the plan leaves free on each rank (its device's memory below
`spec.placement.memoryHeadroom`, less its weights, activations, runtime overhead and staging),
as vLLM's `gpu_memory_utilization` sizes it from what the weights leave; `spec.model.maxBatchSize`
only caps the sequences running at once. docs/planner.md, "KV cache", says how."""

from __future__ import annotations

from pydantic import ConfigDict, Field, field_validator, model_validator

from shard_contract.units import parse_bytes

from .base import ApiModel

QUANTITY = r"^[0-9]*[.]?[0-9]+([kKmMgGtT][iI]?)?[bB]?$"
# What a GPU rank's KV cache takes of its free memory when the spec says nothing: most of it, with
# a tenth left for what the plan's estimates miss (vLLM leaves the same tenth of the whole device).
DEFAULT_GPU_FRACTION = 0.9


class Serving(ApiModel):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "!(has(self.kvCacheMemoryFraction) && has(self.kvCacheMemory))",
        "message": "give at most one of kvCacheMemoryFraction and kvCacheMemory"}]})

    kv_cache_memory_fraction: float | None = Field(None, gt=0.0, le=1.0, description=(
        "Share of the memory the plan leaves free on each rank (below memoryHeadroom, after its "
        "weights, activations and runtime overhead) that its KV cache takes; the group's token "
        "capacity is its smallest rank's. Default: 0.9 on GPUs; on CPUs unset, and the cache holds "
        "maxBatchSize sequences of maxModelLen tokens."))
    kv_cache_memory: str | None = Field(None, json_schema_extra={"pattern": QUANTITY}, description=(
        "Bytes of KV cache on each rank, a quantity such as 20Gi (instead of a fraction); the plan "
        "fails when a rank has not that much free."))

    @field_validator("kv_cache_memory")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None and parse_bytes(value) <= 0:
            raise ValueError(f"must be a positive quantity (got {value!r})")
        return value

    @model_validator(mode="after")
    def _at_most_one(self) -> Serving:
        if self.kv_cache_memory_fraction is not None and self.kv_cache_memory is not None:
            raise ValueError("give at most one of kvCacheMemoryFraction and kvCacheMemory")
        return self

    @property
    def kv_cache_bytes(self) -> int | None:
        return None if self.kv_cache_memory is None else parse_bytes(self.kv_cache_memory)
