"""The wire types between the planes: what a group's leader answers and what it is asked.

The operator reads `GET /v1/shards` from rank 0 of every ready group (`ShardsResponse`); every
rank serves it (each knows the whole group through the heartbeats). `shardctl generate` hands the
leader a `GenerateTask` and reads a `GenerateResult`; the HTTP server turns OpenAI requests into
`GenerateRequest`s and answers with `Completion`s.

`GET /health` is 200 while the process and every rank of its group are alive (else 503 with the
reason); `GET /ready` is 200 once every rank has loaded and its measured memory has been checked
against the plan. Both answer on every rank's SHARD_PORT from the moment it starts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .plan import RankPlan

# The sampling parameters' accepted ranges, OpenAI's: the server's request schema and every
# request the engine runs share them, and the engine samples safely over all of them.
TEMPERATURE_MAX = 2.0
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # a signed 64-bit integer
PENALTY_MAX = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
REPETITION_MAX = 100.0  # repetition_penalty in (0, 100]: 1 is off (vLLM's and HF's meaning)
BIAS_MAX = 100.0  # a logit_bias value lies in [-100, 100], as OpenAI's
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
MAX_LOGPROBS = 20  # top logprobs per position, as OpenAI's


class GenerateRequest(BaseModel):
    """One sequence to continue. temperature 0 is greedy; a seed makes sampling repeatable."""

    prompt_ids: list[int] = Field(min_length=1)
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=TEMPERATURE_MAX)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = Field(0, ge=SEED_MIN, le=SEED_MAX)
    stop: list[str] = Field(default_factory=list, description="Stop strings (need tokenizer.json).")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 keeps all.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens less likely than min_p times the most "
                                                          "likely one (after the temperature).")
    presence_penalty: float = Field(0.0, ge=-PENALTY_MAX, le=PENALTY_MAX)
    frequency_penalty: float = Field(0.0, ge=-PENALTY_MAX, le=PENALTY_MAX)
    repetition_penalty: float = Field(1.0, gt=0.0, le=REPETITION_MAX)
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS,
                                         description="Token id -> a value in [-100, 100] added to its logit.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "Return each generated token's log-probability and this many most likely alternatives' (None: none)."))
    prompt_logprobs: bool = Field(False, description="Return the prompt tokens' log-probabilities (echo).")
    json_schema: str | None = Field(None, description="Constrain the output to JSON valid under this schema "
                                                      "(text; needs tokenizer.json); it ends at an EOS token.")

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias: dict[int, float]) -> dict[int, float]:
        bad = [t for t, v in bias.items() if t < 0 or not -BIAS_MAX <= v <= BIAS_MAX]
        if bad:
            raise ValueError(f"logit_bias: token ids must be >= 0 and values in [-{BIAS_MAX:g}, {BIAS_MAX:g}] "
                             f"(token {bad[0]})")
        return bias

    @field_validator("stop")
    @classmethod
    def _encodable(cls, stops: list[str]) -> list[str]:
        # A request crosses the pipeline as UTF-8 JSON: a lone surrogate could not.
        for stop in stops:
            try:
                stop.encode()
            except UnicodeEncodeError:
                raise ValueError(f"stop string {stop!r} is not valid Unicode") from None
        return stops


class GenerateTask(BaseModel):
    requests: list[GenerateRequest] = Field(min_length=1)


class Completion(BaseModel):
    token_ids: list[int] = Field(description="Generated tokens only (an EOS that ended it included).")
    text: str | None = Field(None, description="Decoded, cut before a stop string; None without a tokenizer.")
    # cancelled: the client left (never sent to it); error: this sequence failed, the others ran on
    finish_reason: Literal["stop", "length", "cancelled", "error"]
    error: str | None = Field(None, description="Why the sequence failed (finish_reason error).")
    logprobs: list[float] | None = Field(None, description="Each generated token's log-probability (the "
                                         "model's, before temperature, penalties and filters), when asked.")
    top_logprobs: list[list[tuple[int, float]]] | None = Field(
        None, description="Per generated token, the most likely (token id, log-probability) pairs, when asked.")
    prompt_logprobs: list[float | None] | None = Field(
        None, description="Per prompt token, its log-probability given those before it (None for the first).")
    cached_tokens: int = Field(0, description="Prompt tokens whose KV came from the prefix cache, not prefilled.")
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = Field(
        None, description="Per prompt token, the most likely (token id, log-probability) pairs at its position.")


class ResidentBytes(BaseModel):
    """Measured after load. On a CPU, weights and kv_cache are the growth of anonymous resident
    memory while they were allocated and filled; on a GPU, of what CUDA's caching allocator reserved."""

    weights: int
    kv_cache: int
    staging: int = Field(0, description=(
        "An offloading rank's staging slots (a CPU rank computing in place: 0; a GPU's pinned host copies: 0)."))
    rss_anon: int
    cuda_allocated: int = 0
    total: int = Field(description="What this rank holds: on a CPU, anonymous memory above a bare `import torch`; "
                                   "on a GPU, device memory in use above what it held when CUDA started in the "
                                   "process (torch's allocator, NCCL's buffers, cuBLAS workspaces).")
    peak: int = Field(0, description="Peak resident set above a bare `import torch` so far (on a GPU: device "
                                     "memory at the warm-up's peak, total + activations).")
    activations: int = Field(0, description="Measured by the warm-up pass before ready: what the plan's largest "
                                            "forward pass (maxBatchSize rows x one prefill chunk) took above what "
                                            "the rank held before it, at its peak.")


class RankReport(BaseModel):
    """What one rank measured once it had loaded (`ShardEntry.report`). Where it runs and what the
    plan predicted are its `RankPlan`'s, beside it in the entry, never copied here."""

    dtype: str = Field("", description="What the rank runs: the plan's dtype, or float16 where a GPU has no "
                                       "native bfloat16.")
    resident_bytes: ResidentBytes
    allocated_bytes: dict[str, int] = Field(default_factory=dict,
                                            description="Bytes of the tensors themselves: weights, kv_cache.")
    load_seconds: float
    comm_seconds: float
    compute_seconds: float
    idle_seconds: float
    comm_bytes: dict[str, int] = Field(default_factory=dict, description="By operation.")
    streamed_bytes: int = Field(0, description=(
        "Offload: bytes of streamed layers brought in (copied into staging slots, or mapped in place on a CPU)."))
    stream_seconds: float = Field(0.0, description="Offload: seconds spent streaming them.")
    stall_seconds: float = Field(0.0, description=(
        "Offload: seconds the forward pass's thread waited for the prefetch thread to deliver a streamed layer "
        "(a CPU rank's whole stall; on a GPU the host's wait, the device's being device_stall_seconds)."))
    device_stall_seconds: float = Field(0.0, description=(
        "Offload, GPU: seconds the compute stream waited for a streamed layer's copy (CUDA events)."))
    last_generate: dict[str, float] = Field(default_factory=dict,
                                            description="seconds, comm_seconds, compute_seconds, idle_seconds "
                                                        "(and offload's streamed_bytes, stream_seconds, "
                                                        "stall_seconds, device_stall_seconds) of the latest "
                                                        "generate call, complete at its end")


class LoadProgress(BaseModel):
    """How far a rank has read its slices of the checkpoint."""

    loaded: int = Field(description="Bytes of this rank's tensors filled so far.")
    total: int = Field(description="Bytes of all its tensors.")


class ShardEntry(BaseModel):
    """One rank in `GET /v1/shards` and `shardctl generate --json`: its place in the plan, what it
    measured once it has loaded, and its health."""

    model_config = ConfigDict(extra="forbid")

    plan: RankPlan
    report: RankReport | None = Field(None, description="What it measured; None until it has loaded.")
    alive: bool = True
    state: str = Field("starting", description="planned, starting, loading, ready, failed or broken")
    problems: list[str] = Field(default_factory=list, description="A failed memory check.")
    load_progress: LoadProgress | None = Field(None, description="While it loads, and after.")


class GenerateResult(BaseModel):
    completions: list[Completion]
    ranks: list[ShardEntry] = Field(description="Every rank of the group: its plan and its report.")
    prefill_seconds: float = Field(description="Task start to the first tokens.")
    decode_seconds: float
    decode_steps: int


class ShardsResponse(BaseModel):
    """`GET /v1/shards`: every rank of one group."""

    model: str
    replica: int
    ready: bool
    reason: str = Field("", description="Why the group is not ready.")
    predicted_step_seconds: float = Field(0.0, description="The plan's estimate of one decode step "
                                                           "(its critical path through every stage).")
    kv_cache_tokens: int = Field(0, description="Tokens of KV cache the group holds (its capacity).")
    kv_cache_used_tokens: int = Field(0, description="Of those, the tokens its running requests held at the "
                                                     "latest step.")
    prefix_cache_queries: int = Field(0, description="Prompt KV blocks looked up in the prefix cache since the "
                                                     "leader started.")
    prefix_cache_hits: int = Field(0, description="Of those, the blocks found: their prefill was not computed again.")
    ranks: list[ShardEntry]

    def measured_by_rank(self) -> dict[int, Measured]:
        """rank -> what it measured, for every rank that has measured."""
        return {r.plan.rank: Measured(resident=r.report.resident_bytes.total, streamed_bytes=r.report.streamed_bytes,
                                      stream_seconds=r.report.stream_seconds, stall_seconds=r.report.stall_seconds,
                                      device_stall_seconds=r.report.device_stall_seconds)
                for r in self.ranks if r.report is not None}


class Measured(BaseModel):
    """What the operator keeps of a rank's report for the status: its resident bytes (total) and,
    when it streams layers, its streaming counters."""

    resident: int
    streamed_bytes: int = 0
    stream_seconds: float = 0.0
    stall_seconds: float = 0.0
    device_stall_seconds: float = 0.0
