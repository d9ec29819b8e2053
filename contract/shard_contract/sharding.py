"""How a Llama-family model splits over tensor-parallel ranks: the rules both planes follow.

The planner sizes each rank by them and the worker allocates exactly those shapes (its tests
compare measured bytes with the planner's numbers):

* Column/row-parallel projections: 1/TP of the rows/columns per rank.
* K/V projections and the KV cache: ceil(kv_heads / TP) heads per rank -- when TP exceeds the KV
  heads, each rank keeps a replica of one head (two 12 GB GPUs are not one 24 GB GPU).
* Embeddings and the LM head: vocabulary-parallel, ceil(vocab / TP) rows per rank (the last rank's
  tail is padding).
* Norms and row-parallel biases: replicated on every rank.
"""

from __future__ import annotations

from typing import Protocol

# Tokens of one prefill forward pass: longer prompts are prefilled in chunks of this many tokens,
# so activation memory does not grow with maxModelLen.
PREFILL_CHUNK = 512
# The most tokens one forward pass computes (a step's prefill chunks and decodes together), by the
# kind of rank: the planner sizes a rank's activations for it, so they do not grow with
# maxBatchSize beyond it. A GPU's is vLLM's max_num_batched_tokens on an H100; a CPU rank's
# activations are host memory, and its bound lets 64 sequences prefill a chunk together.
MAX_STEP_TOKENS = {"gpu": 8192, "cpu": 32768}


def prefill_rows(max_batch: int, max_len: int, kind: str = "gpu") -> int:
    """Rows of the largest forward pass: a prefill chunk of every running sequence, at most
    MAX_STEP_TOKENS[kind] tokens (at least one row)."""
    return max(1, min(max_batch, MAX_STEP_TOKENS[kind] // min(max_len, PREFILL_CHUNK)))


class Heads(Protocol):
    """What the rules read of a model (a `checkpoint.ModelShape`, a profile, a worker config);
    read-only, so frozen dataclasses and models satisfy it."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def tp_problem(model: Heads, tp: int) -> str | None:
    """Why this model cannot be split over `tp` ranks, or None when it can."""
    if tp < 1:
        return f"tensor={tp} is not a positive number of ranks"
    if model.num_heads % tp:
        return f"tensor={tp} does not divide the {model.num_heads} attention heads"
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        return f"tensor={tp} and the {model.num_kv_heads} KV heads do not divide one another"
    if model.intermediate_size % tp:
        return f"tensor={tp} does not divide the MLP width {model.intermediate_size}"
    return None


def valid_tensor_degrees(model: Heads, limit: int) -> list[int]:
    return [tp for tp in range(1, limit + 1) if tp_problem(model, tp) is None]


def kv_heads_per_rank(model: Heads, tp: int) -> int:
    """ceil(kv / TP): with more ranks than KV heads each rank keeps a copy of one head."""
    return ceil_div(model.num_kv_heads, tp)


def kv_head_start(model: Heads, tp: int, tp_rank: int) -> int:
    return tp_rank * model.num_kv_heads // tp


def vocab_rows_per_rank(model: Heads, tp: int) -> int:
    return ceil_div(model.vocab_size, tp)
