"""How a worker rank is configured: environment variables, written by the operator (pod env) and
by `shardctl` (local processes), read by `python -m shard_worker`. One code path for both.

The leader's HTTP contract that the operator reads (`GET /v1/shards` on rank 0 of a group):

    {"model": str, "replica": int, "ready": bool,
     "ranks": [{"rank", "stage", "tp_rank", "layers": [start, stop), "node", "device",
                "predicted_bytes": {"weights", "kv_cache", "activations", "overhead", "total"},
                "resident_bytes": {"weights", "kv_cache", "rss_anon", "cuda_allocated", "total"},
                "load_seconds", "comm_seconds", "compute_seconds", "idle_seconds", "alive": bool}]}

Every rank serves it (each knows the whole group through the heartbeats). Also there, for people:
"reason" (why not ready), and per rank "state" (starting, loading, ready, failed, broken),
"problems" (a failed memory check), and the rest of its `RankReport`. A rank that has not loaded
yet has no "resident_bytes".

`GET /health` is 200 while the process and every rank of its group are alive (else 503 with the
reason); `GET /ready` is 200 once every rank has loaded and its measured memory has been checked
against the plan. Both answer on every rank's SHARD_PORT from the moment it starts.
"""

from __future__ import annotations

import os
from typing import Literal, Mapping

from pydantic import BaseModel, Field, ValidationError

from .plan import PredictedBytes

# field -> environment variable
ENV_NAMES = {
    "rank": "RANK",
    "world_size": "WORLD_SIZE",
    "local_rank": "LOCAL_RANK",
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
    "tp_size": "TP_SIZE",
    "pp_size": "PP_SIZE",
    "replica": "SHARD_REPLICA",
    "plan_file": "SHARD_PLAN",
    "model_dir": "SHARD_MODEL_DIR",
    "model_name": "SHARD_MODEL_NAME",
    "port": "SHARD_PORT",
    "backend": "SHARD_BACKEND",
    "rendezvous_timeout": "SHARD_RENDEZVOUS_TIMEOUT",
    "memory_budget_bytes": "SHARD_MEMORY_BUDGET",
}

PLAN_MOUNT = "/etc/shard-operator/plan.json"  # where pods find the plan (ConfigMap)
MODEL_MOUNT = "/models"  # where pods find the model volume


class WorkerEnvError(ValueError):
    pass


class WorkerEnv(BaseModel):
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    local_rank: int = Field(0, ge=0)
    master_addr: str = "127.0.0.1"
    master_port: int = Field(29500, ge=1, le=65535)
    tp_size: int = Field(ge=1)
    pp_size: int = Field(ge=1)
    replica: int = Field(0, ge=0)
    plan_file: str
    model_dir: str
    model_name: str = "model"
    port: int = Field(8000, ge=0, le=65535, description="This rank's HTTP port (API on rank 0, metrics on all).")
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    rendezvous_timeout: int = Field(600, ge=1, description="Seconds to wait for the group to assemble.")
    memory_budget_bytes: int | None = Field(None, description="Enforced memory budget of a simulated device.")

    def to_env(self) -> dict[str, str]:
        return {ENV_NAMES[k]: str(v) for k, v in self.model_dump().items() if v is not None}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "WorkerEnv":
        environ = os.environ if environ is None else environ
        values = {field: environ[name] for field, name in ENV_NAMES.items() if name in environ}
        try:
            env = cls.model_validate(values)
        except ValidationError as err:
            problems = "; ".join(f"{ENV_NAMES.get(str(e['loc'][0]), e['loc'][0])}: {e['msg']}" for e in err.errors())
            raise WorkerEnvError(f"worker environment is incomplete or invalid: {problems}") from None
        if env.world_size != env.tp_size * env.pp_size:
            raise WorkerEnvError(f"WORLD_SIZE={env.world_size} is not TP_SIZE x PP_SIZE = {env.tp_size * env.pp_size}")
        if env.rank >= env.world_size:
            raise WorkerEnvError(f"RANK={env.rank} is outside WORLD_SIZE={env.world_size}")
        return env


# ---------------------------------------------------------------- one-shot generation and reports
# `shardctl generate` hands the leader a task file and reads its result file: the group runs the
# task and exits. Without SHARD_TASK the leader serves HTTP instead.
TASK_ENV = "SHARD_TASK"  # path of a GenerateTask JSON file
RESULT_ENV = "SHARD_RESULT"  # where the leader writes the GenerateResult JSON


class GenerateRequest(BaseModel):
    """One sequence to continue. temperature 0 is greedy; a seed makes sampling repeatable."""

    prompt_ids: list[int] = Field(min_length=1)
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = 0
    stop: list[str] = Field(default_factory=list, description="Stop strings (need tokenizer.json).")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False


class GenerateTask(BaseModel):
    requests: list[GenerateRequest] = Field(min_length=1)


class Completion(BaseModel):
    token_ids: list[int] = Field(description="Generated tokens only (an EOS that ended it included).")
    text: str | None = Field(None, description="Decoded, cut before a stop string; None without a tokenizer.")
    finish_reason: Literal["stop", "length", "cancelled"]  # cancelled: the client left (never sent to it)


class ResidentBytes(BaseModel):
    """Measured after load. On a CPU, weights and kv_cache are the growth of anonymous resident
    memory while they were allocated and filled; on a GPU, of CUDA's allocated bytes."""

    weights: int
    kv_cache: int
    rss_anon: int
    cuda_allocated: int = 0
    total: int = Field(description="What this rank holds above a bare `import torch` (GPU: reserved).")
    peak: int = Field(0, description="Peak resident set above a bare `import torch` so far.")


class RankReport(BaseModel):
    """One rank's line in `GET /v1/shards` and in `shardctl generate --json`."""

    rank: int
    stage: int
    tp_rank: int
    layers: tuple[int, int]
    node: str = ""
    device: str = ""
    predicted_bytes: PredictedBytes
    resident_bytes: ResidentBytes
    allocated_bytes: dict[str, int] = Field(default_factory=dict,
                                            description="Bytes of the tensors themselves: weights, kv_cache.")
    load_seconds: float
    comm_seconds: float
    compute_seconds: float
    idle_seconds: float
    comm_bytes: dict[str, int] = Field(default_factory=dict, description="By operation.")
    last_generate: dict[str, float] = Field(default_factory=dict,
                                            description="seconds, comm_seconds, compute_seconds, idle_seconds "
                                                        "of the latest generate call")
    alive: bool = True


class GenerateResult(BaseModel):
    completions: list[Completion]
    ranks: list[RankReport]
    prefill_seconds: float = Field(description="Task start to the first tokens.")
    decode_seconds: float
    decode_steps: int
