"""How a worker rank is configured: environment variables, written by the operator (pod env) and
by `shardctl` (local processes), read by `python -m shard_worker`. One code path for both.

The HTTP contract between a group's ranks and the operator lives in `wire.py`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from .sharding import STEP_TOKENS

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
    "bind_addr": "SHARD_BIND_ADDR",
    "group_secret_file": "SHARD_GROUP_SECRET_FILE",
    "api_key_file": "SHARD_API_KEY_FILE",
    "max_body_bytes": "SHARD_MAX_BODY_BYTES",
    "read_timeout": "SHARD_READ_TIMEOUT",
    "text_timeout": "SHARD_TEXT_TIMEOUT",
}

# The serving limits: their defaults suit most groups, and an operator of a group may change them.
TUNABLE = ("max_body_bytes", "read_timeout", "text_timeout")

PLAN_MOUNT = "/etc/shard-operator/plan.json"  # where pods find the plan (ConfigMap)
API_KEY_MOUNT = "/etc/shard-operator/api-key/key"  # where a leader pod finds its API key (Secret)
MODEL_MOUNT = "/models"  # where pods find the model volume
SECRET_MOUNT = "/var/run/secrets/sharding.dev"  # where pods find their group's Secret (a volume)
SECRET_KEY = "group-key"  # the Secret's key, a file in SECRET_MOUNT
GROUP_KEY_BYTES = 32  # the secret key of one group, which authenticates its ranks' heartbeat records

# Settings of a rank's process beside WorkerEnv, read where they act (a default suits every group;
# a pod's env or the dev cluster sets them): named here, so every side spells them alike.
HOST_ENV = "SHARD_HOST"  # the address a rank's HTTP server listens on (default 0.0.0.0)
# TP ranks of one machine sum small tensors through shared memory; "0" turns it off.
SHM_ENV = "SHARD_SHM_COLLECTIVES"
# Where that shared buffer lives: /dev/shm, which the ranks of one pod share and those of different
# pods do not; the dev cluster, whose pods are processes of one machine, points each pod elsewhere.
SHM_DIR_ENV = "SHARD_SHM_DIR"
KERNEL_ENV = "SHARD_KERNEL"  # the CPU kernels: auto (the best this CPU runs), torch, or a level
FUSED_LAYERS_ENV = "SHARD_FUSED_LAYERS"  # "0": CPU decoder layers in Python, not the fused C layer
# How a rank runs its decode steps (shard_worker.engine.graphs): auto, off, eager, cuda or compile.
DECODE_GRAPHS_ENV = "SHARD_DECODE_GRAPHS"
# How the torch path reads the paged KV cache (shard_worker.model.paged): auto, flex (in place) or gather.
PAGED_ATTENTION_ENV = "SHARD_PAGED_ATTENTION"
# "0": the leader serves HTTP from its engine's process instead of an HTTP process of its own.
HTTP_PROCESS_ENV = "SHARD_HTTP_PROCESS"
# The leader's HTTP process's end of its pipe to the engine process (set by the engine process).
ENGINE_FD_ENV = "SHARD_ENGINE_FD"
# The engine's per-step token budget (decodes + prompt chunks; sharding.STEP_TOKENS by device kind)
STEP_TOKENS_ENV = "SHARD_STEP_TOKENS"


def step_token_budget(device_type: str, environ: Mapping[str, str] | None = None) -> int:
    """The per-step token budget of a rank whose torch device type is `device_type` ("cuda": a
    GPU's, else a CPU's), or SHARD_STEP_TOKENS when set (at least 1)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(STEP_TOKENS_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            raise WorkerEnvError(f"{STEP_TOKENS_ENV}={raw!r} is not an integer") from None
        if value < 1:
            raise WorkerEnvError(f"{STEP_TOKENS_ENV}={raw!r}: the budget is at least one token")
        return value
    return STEP_TOKENS["gpu" if device_type == "cuda" else "cpu"]

# The worker's commands: one rank (`python -m shard_worker`), or a pod's ranks, one process each
# (`python -m shard_worker.launch --local-ranks N`).
WORKER_MODULE = "shard_worker"
LAUNCH_MODULE = "shard_worker.launch"
WORKER_COMMAND = ("python", "-m", WORKER_MODULE)
LAUNCH_COMMAND = ("python", "-m", LAUNCH_MODULE, "--local-ranks")  # + the pod's rank count

# How a rank's process ends when it fails: EXIT_FAILED when a restart may succeed (a peer that never
# joined, a lost collective, a crash), EXIT_CONFIG (sysexits.h's EX_CONFIG) when its plan, its
# checkpoint or its environment is wrong and a restart would fail the same way: `shardctl run` and
# the operator give up at once on it instead of restarting the group.
EXIT_FAILED = 1
EXIT_CONFIG = 78


def new_group_key() -> bytes:
    """A fresh group key: `shardctl run` and the operator make one for every group they start."""
    return secrets.token_bytes(GROUP_KEY_BYTES)


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
    bind_addr: str | None = Field(None, description="The one address rank 0's rendezvous store listens on (the "
                                                    "pod IP; default: the address MASTER_ADDR resolves to).")
    group_secret_file: str | None = Field(None, description="A file holding the group's secret key, which "
                                                            "authenticates every heartbeat record (needed to serve).")
    api_key_file: str | None = Field(None, description="A file holding the key the leader's OpenAI routes require "
                                     "(Authorization: Bearer); none: no key.")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="The largest request body a rank reads; a larger "
                                "one is refused (413) before it is buffered.")
    read_timeout: float = Field(30.0, gt=0, description="Seconds a client has to send a request's headers, and "
                                "again its body; a slower one is cut off (408).")
    text_timeout: float = Field(10.0, gt=0, description="Seconds the leader gives one request's tokenizing and "
                                "chat-template rendering; a request that takes longer fails alone (503).")

    def to_env(self) -> dict[str, str]:
        """The variables that say this environment; a tunable at its default is left out, so that
        a pod's own env (spec.worker.env) or the environment `shardctl run` inherits may set it."""
        defaults = {k: WorkerEnv.model_fields[k].default for k in TUNABLE}
        return {ENV_NAMES[k]: str(v) for k, v in self.model_dump().items()
                if v is not None and not (k in defaults and v == defaults[k])}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
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


def read_api_key(path: str | os.PathLike[str]) -> bytes:
    """The key in an API key file (SHARD_API_KEY_FILE): its bytes, surrounding whitespace
    stripped (a trailing newline is no part of the key); never empty."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as err:
        raise WorkerEnvError(f"SHARD_API_KEY_FILE {path}: {err.strerror or err}") from None
    if not key:
        raise WorkerEnvError(f"SHARD_API_KEY_FILE {path} is empty")
    return key


# ---------------------------------------------------------------- one-shot generation
# `shardctl generate` hands the leader a task file and reads its result file: the group runs the
# task and exits. Without SHARD_TASK the leader serves HTTP instead.
TASK_ENV = "SHARD_TASK"  # path of a GenerateTask JSON file
RESULT_ENV = "SHARD_RESULT"  # where the leader writes the GenerateResult JSON
