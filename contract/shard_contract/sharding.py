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
# The paged KV cache (the worker's model/paging.py lays it out): a rank's pool is blocks of
# KV_BLOCK_SIZE positions; a sequence holds whole blocks, and KV_RESERVED_BLOCKS are no sequence's
# (ZERO, which padding columns read, and TRASH, which takes the writes no sequence keeps). A plan's
# kvCacheTokens is what sequences can hold (whole blocks); the pool is that and the reserved blocks.
KV_BLOCK_SIZE = 16
KV_RESERVED_BLOCKS = 2
# Whether a kind of rank's torch attention copies each row's context out of the paged pool (the
# keys and values of every column a pass attends to, one layer at a time) rather than reading the
# blocks in place: a prefill chunk after the first and a decode step on the torch path do. The
# planner counts that copy in a rank's activations (sizing.gathered_kv_bytes).
KV_GATHERED = {"gpu": True, "cpu": True}


def kv_blocks(tokens: int) -> int:
    """Blocks that hold `tokens` positions of one sequence (or of a pool's sequences)."""
    return ceil_div(tokens, KV_BLOCK_SIZE)


def kv_whole_blocks(tokens: int) -> int:
    """`tokens` rounded up to whole blocks: what a sequence of that length takes of the cache."""
    return kv_blocks(tokens) * KV_BLOCK_SIZE


def kv_pool_tokens(tokens: int) -> int:
    """Positions a rank's pool allocates so that its sequences can hold `tokens`: whole blocks and
    the reserved ones (what the planner sizes in bytes)."""
    return (kv_blocks(tokens) + KV_RESERVED_BLOCKS) * KV_BLOCK_SIZE


def kv_sequence_tokens(pool_tokens: int) -> int:
    """The inverse: what sequences can hold of a pool with room for `pool_tokens` positions (whole
    blocks, less the reserved ones; 0 when it holds no more than those)."""
    return max(pool_tokens // KV_BLOCK_SIZE - KV_RESERVED_BLOCKS, 0) * KV_BLOCK_SIZE
# The per-step token budget of a continuous batch: each step computes its decodes and, with what
# is left, chunks of the prompts of those who joined it (the worker's engine/chunking.py), so a long
# prompt delays the running streams by at most one step's budget a step. It is the number of
# prompt tokens that cost about one decode step, so a step with a chunk takes at most about twice
# one without. A decode step reads every weight once (memory bound: 2 bytes a parameter at 16
# bits, over the memory bandwidth); a chunk of n tokens does 2n FLOPs a parameter (compute bound):
# they cost the same at n = FLOP/s / (bytes/s), the machine's ridge point: an H100's 989 TFLOP/s
# (bf16 dense) over 3.35 TB/s is ~300, hence 256 (the decodes and attention take the rest). A
# CPU core's is a few FLOPs a byte (fp32 weights: 4 bytes a parameter; AVX2/AVX-512 FMAs at a
# few tens of GFLOP/s against ~10-20 GB/s), so the CPU's is measured, not derived:
# bench/step_budget.py on the serve bench's demo model (51.5M, float32, one rank of 2 threads) on
# the 2-vCPU bench machine, 2026-12-06 18:09-18:22 UTC, niced, 1-min load 1.6-3.3 (about 2 of it the
# bench's own threads; 4 ABBA rounds): beside the serve bench's 8 short streams (a 14-17 ms step), a chunk of
# a 1900-token prompt costs ~20 ms plus ~1.2 ms a token (the torch prefill path; each chunk
# attends to the whole prompt before it), so a step with an 8-token chunk took 3.0x one without
# (3.4x at the deepest chunks), 16 tokens 5.6x, 32 5.9x, 256 25x. No chunk size meets the serve
# bench's <= 2x: 16 gives the smallest measured (8-token chunks beside 8 decodes, at least 8 beside
# more: 1.35x beside 63), at the price of a long prompt's first token (1900 tokens: ~240 steps).
# The <= 2x goal needs a cheaper chunk, not a smaller budget (docs/benchmarks.md, The step budget).
# SHARD_STEP_TOKENS overrides it (contract env.py).
STEP_TOKENS = {"gpu": 256, "cpu": 16}


def prefill_rows(max_batch: int, max_len: int, kind: str = "gpu") -> int:
    """Rows of the largest prefill forward pass: a prefill chunk of as many running sequences as
    MAX_STEP_TOKENS[kind] tokens allow (at least one row). The worker prefills a batch's prompts in
    units of at most these rows (its warm-up runs one), while up to maxBatchSize rows decode."""
    return max(1, min(max_batch, MAX_STEP_TOKENS[kind] // min(max_len, PREFILL_CHUNK)))


# The decode step a GPU rank replays (the worker's engine/graphs.py): one captured graph per batch
# bucket and context bucket, each keeping its output for the rank's life (the planner counts them).
DECODE_MIN_LENGTH = 256  # the shortest context bucket: below it, reading more columns costs nothing


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def length_buckets(max_len: int, shortest: int = DECODE_MIN_LENGTH) -> list[int]:
    """`shortest`, twice that, ... below max_len, then max_len."""
    out, n = [], shortest
    while n < max_len:
        out.append(n)
        n *= 2
    return out + [max_len]


# Query columns a block of a paged attention mask covers (the worker's model/paged.py): a decode
# step's one column takes a block, a prefill chunk's columns one per MASK_QUERY_BLOCK.
MASK_QUERY_BLOCK = 128
# Whether a kind of rank builds a block mask over its whole pool for each pass that reads it in
# place (FlexAttention, model/paged.py): a GPU rank does; a CPU rank with the C kernels (the
# default build) reads in place in its decode attention without one and gathers for a later chunk.
# The planner counts those masks in a GPU rank's activations (sizing.mask_bytes).
PAGED_MASKS = {"gpu": True, "cpu": False}


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
