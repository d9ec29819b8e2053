"""Bytes one rank holds, and seconds one stage takes: the planner's arithmetic.

How a Llama shards (heads, KV heads, vocabulary rows per rank) is the contract's
(`shard_contract.sharding`), which the worker follows when it allocates; this module turns those
rules into bytes and seconds. The first stage embeds; the last stage holds the final norm and the
LM head. Tied embeddings are stored once when one stage does both, twice when they are different
stages.

With `quantization="int8"` the decoder layers' projection matrices take 1 byte a weight plus one
float32 scale per output row (a row-parallel rank keeps the scales of whole rows: all of them);
their biases, the norms, the embeddings and the LM head stay in the runtime dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_contract.sharding import (
    KV_BLOCK_SIZE,
    KV_GATHERED,
    MASK_QUERY_BLOCK,
    PAGED_MASKS,
    PREFILL_CHUNK,
    batch_buckets,
    ceil_div,
    kv_heads_per_rank,
    kv_pool_tokens,
    kv_whole_blocks,
    length_buckets,
    prefill_rows,
    vocab_rows_per_rank,
)
from shard_contract.units import MiB

from .profile import ModelProfile

# What a rank needs beyond weights, KV cache and activations. On a GPU: the CUDA context with its
# lazily loaded kernels and cuBLAS workspaces (1.8 GiB of non-torch memory has been logged on an
# H100 at TP=1), and NCCL's buffers at TP > 1 (NCCL_BUFFSIZE, 4 MiB, per channel and peer: a few
# hundred MiB with NVLink peers). On a CPU: the process's share above a bare `import torch` (gloo
# buffers, allocator slack). Settable: PlannerOptions.runtime_overhead.
RUNTIME_OVERHEAD = {"gpu": 2560 * MiB, "cpu": 64 * MiB}

# NCCL's NVLink SHARP (NVLS) buffers on NVSwitch systems: about 0.3 GiB per rank for each of its
# communicators (issue 26's estimate, not measured here: no multi-GPU machine), allocated when a
# communicator starts. Off unless the spec asks (NCCL_NVLS_ENABLE=0), as NeMo's launcher
# (NVIDIA/NeMo-Framework-Launcher#127) and sglang (sgl-project/sglang#631) turn it off to save memory.
NVLS_BYTES = 300 * MiB


def nvls_bytes(nvls: bool, kind: str, tp: int, pipeline: bool) -> int:
    """NVLS buffers of one GPU rank (`pipeline`: its group has more than one stage): one set for the
    group's world communicator and one for its stage's tensor-parallel group when that is another.
    Counted whether or not the communicator's ranks share a node (an upper bound)."""
    if not nvls or kind != "gpu":
        return 0
    return NVLS_BYTES * (int(tp > 1 or pipeline) + int(tp > 1 and pipeline))

# The sampler's working set per logit of the rows it draws for (the worker's engine/sampling.py, on
# every rank of the last stage): a draw with top_p or top_k holds about nine [rows, vocab] float64
# tensors at once (the logits as float64, scaled, their probabilities, the sorted ones and their
# order, the cumulative sums, the Gumbel noise's hashes), and a row with penalties keeps its token
# counts (int32) and prompt mask (bool). Counted from the code, not measured.
SAMPLER_LOGIT_BYTES = 9 * 8 + 4 + 1
# What building one pass's block mask holds at its peak (the worker's model/paged.py `paged_mask`),
# per row and query block, per block of the pool: the logical block ids, their table entries, the
# selection of those the row reads and a temporary (int64 each), and the int32 inverse table and
# indices the mask keeps for the pass. Counted from the code, not measured.
MASK_BYTES_PER_BLOCK = 4 * 8 + 4 + 4

QUANTIZATIONS = ("none", "int8")
SCALE_BYTES = 4  # one float32 scale per output row of an int8 matrix


@dataclass(frozen=True)
class Shard:
    """One rank's part of the model: what the sizing functions take."""

    tp: int
    layers: tuple[int, int]
    embeds: bool
    has_lm_head: bool


def layer_weight_numel(profile: ModelProfile, layer: int, tp: int) -> int:
    lp = profile.layers[layer]
    kv_share = kv_heads_per_rank(profile.shape, tp) / profile.shape.num_kv_heads
    return lp.column // tp + round(lp.kv * kv_share) + lp.row // tp + lp.replicated


def layer_weight_bytes(profile: ModelProfile, layer: int, tp: int, dtype: str = "auto",
                       quantization: str = "none") -> int:
    size = profile.dtype_bytes(dtype)
    if quantization == "none":
        return layer_weight_numel(profile, layer, tp) * size
    lp = profile.layers[layer]
    kv_share = kv_heads_per_rank(profile.shape, tp) / profile.shape.num_kv_heads
    matrices = lp.column_matrix // tp + round(lp.kv_matrix * kv_share) + lp.row // tp
    scales = lp.column_rows // tp + round(lp.kv_rows * kv_share) + lp.row_rows
    others = (lp.column - lp.column_matrix) // tp + round((lp.kv - lp.kv_matrix) * kv_share) + lp.replicated
    return matrices + scales * SCALE_BYTES + others * size


def layer_streamed_bytes(profile: ModelProfile, layer: int, tp: int, dtype: str = "auto") -> int:
    """What an offloading rank streams of one layer: its slices of the projection matrices (biases
    and norms stay resident), in the runtime dtype."""
    lp = profile.layers[layer]
    kv_share = kv_heads_per_rank(profile.shape, tp) / profile.shape.num_kv_heads
    return (lp.column_matrix // tp + round(lp.kv_matrix * kv_share) + lp.row // tp) * profile.dtype_bytes(dtype)


def layer_copied_bytes(profile: ModelProfile, layer: int, tp: int, dtype: str = "auto", kind: str = "gpu") -> int:
    """Of `layer_streamed_bytes`, what an offloading rank copies into its staging slots each time
    it streams the layer in: a GPU rank all of it (into device memory); a CPU rank computes on the
    mapped checkpoint in place and copies only what it cannot: every matrix when the runtime dtype
    is not the checkpoint's, else those whose data are not aligned to their element size (none,
    from a standard writer)."""
    if kind == "gpu" or dtype not in ("auto", profile.dtype):
        return layer_streamed_bytes(profile, layer, tp, dtype)
    lp = profile.layers[layer]
    kv_share = kv_heads_per_rank(profile.shape, tp) / profile.shape.num_kv_heads
    return (lp.unaligned_column // tp + round(lp.unaligned_kv * kv_share) + lp.unaligned_row // tp) \
        * profile.dtype_bytes(dtype)


def layer_read_bytes(profile: ModelProfile, layer: int, tp: int) -> int:
    """Checkpoint bytes read to stream one layer from the files: the rank's row slices, and the
    row-parallel matrices' whole rows (a column slice is read with its rows' other columns, one
    `preadv` for many rows)."""
    lp = profile.layers[layer]
    kv_share = kv_heads_per_rank(profile.shape, tp) / profile.shape.num_kv_heads
    return (lp.column_matrix // tp + round(lp.kv_matrix * kv_share) + lp.row) * profile.dtype_bytes("auto")


def outside_layers_numel(profile: ModelProfile, shard: Shard) -> int:
    """Embeddings, final norm, LM head and unknown tensors: never quantized."""
    numel = 0
    vocab_part = vocab_rows_per_rank(profile.shape, shard.tp) * profile.shape.hidden_size
    if shard.embeds:
        numel += vocab_part
    if shard.has_lm_head:
        numel += profile.final_norm_numel
        if not (profile.shape.tie_word_embeddings and shard.embeds):
            numel += vocab_part
    return numel + profile.other_numel


def weight_bytes(profile: ModelProfile, shard: Shard, dtype: str = "auto", quantization: str = "none") -> int:
    layers = sum(layer_weight_bytes(profile, i, shard.tp, dtype, quantization) for i in range(*shard.layers))
    return layers + outside_layers_numel(profile, shard) * profile.dtype_bytes(dtype)


def kv_token_bytes(profile: ModelProfile, tp: int, layers: int, dtype: str = "auto") -> int:
    """Bytes of one token's keys and values on a rank of `layers` decoder layers at tensor `tp`."""
    shape = profile.shape
    return layers * 2 * kv_heads_per_rank(shape, tp) * shape.head_dim * profile.dtype_bytes(dtype)


def kv_cache_bytes(profile: ModelProfile, shard: Shard, max_len: int, batch: int, dtype: str = "auto") -> int:
    """The paged pool of every layer of the shard, its KV heads, for `batch` sequences of `max_len`
    tokens (whole blocks each) and the reserved blocks."""
    tokens = kv_pool_tokens(batch * kv_whole_blocks(max_len))
    return kv_token_bytes(profile, shard.tp, shard.layers[1] - shard.layers[0], dtype) * tokens


def activation_bytes(profile: ModelProfile, shard: Shard, max_len: int, batch: int, dtype: str = "auto",
                     kind: str = "gpu") -> int:
    """Workspace of the largest forward pass: one prefill chunk of as many running sequences as
    MAX_STEP_TOKENS of its kind allow (`prefill_rows`) through a layer, and what maxBatchSize
    decoding rows add (`running_bytes`).

    Live at once: each token's share (`token_activation_bytes`), what attention allocates on its
    masked path, the context it copies out of the paged pool (`gathered_kv_bytes`), and on the last
    stage the gathered float32 logits of the batch's last tokens. The block masks over the pool
    are counted with it once its size is known (`mask_bytes`).
    """
    tp = shard.tp
    tokens = prefill_rows(batch, max_len, kind) * min(max_len, PREFILL_CHUNK)
    logits = batch * profile.shape.vocab_size * 4 * 2 if shard.has_lm_head else 0
    return tokens * token_activation_bytes(profile, tp, dtype) \
        + attention_workspace_bytes(profile, tp, max_len, batch, dtype, kind) \
        + gathered_kv_bytes(profile, tp, max_len, batch, dtype, kind) + logits \
        + running_bytes(profile, shard, max_len, batch, dtype, kind)


def token_activation_bytes(profile: ModelProfile, tp: int, dtype: str = "auto") -> int:
    """Live at once for each token through a layer: the residual stream and a normalised copy,
    the local q/k/v and attention output, the local gate/up/product of the MLP."""
    shape, act = profile.shape, profile.dtype_bytes(dtype)
    q_local = shape.num_heads // tp * shape.head_dim
    kv_local = kv_heads_per_rank(shape, tp) * shape.head_dim
    return (3 * shape.hidden_size + 2 * q_local + 2 * kv_local + 3 * shape.intermediate_size // tp) * act


def running_bytes(profile: ModelProfile, shard: Shard, max_len: int, batch: int, dtype: str = "auto",
                  kind: str = "gpu") -> int:
    """What up to `batch` (maxBatchSize) decoding rows cost a rank beyond its largest prefill pass.

    On the last stage, the sampler's working set over their logits (`SAMPLER_LOGIT_BYTES`). On a
    GPU rank, the decode steps it replays (the worker's engine/graphs.py): every (batch, context)
    bucket's graph keeps its output (the last stage's float32 logits [rows, vocab], another
    stage's hidden states [rows, 1, hidden]), and the largest step's own memory lives in the
    graphs' pool, beside the eager allocator's prefill peak: its rows through a layer, their
    logits gathered, and its slot maps and mask over maxModelLen columns (`Step.captured`: about
    six int64 [rows, columns] tensors at once, a boolean mask and its additive copy). The block
    masks its passes build grow with the pool: `mask_bytes`."""
    shape, act = profile.shape, profile.dtype_bytes(dtype)
    total = batch * shape.vocab_size * SAMPLER_LOGIT_BYTES if shard.has_lm_head else 0
    if kind == "gpu":
        row_out = shape.vocab_size * 4 if shard.has_lm_head else shape.hidden_size * act
        total += sum(batch_buckets(batch)) * len(length_buckets(max_len)) * row_out
        total += batch * (token_activation_bytes(profile, shard.tp, dtype) + (2 * row_out if shard.has_lm_head else 0)
                          + max_len * (6 * 8 + 1 + act))
    return total


def mask_rows(max_len: int, batch: int, kind: str = "gpu") -> int:
    """Rows x query blocks of the block masks a rank holds at once over its pool (where
    `PAGED_MASKS[kind]`): the largest decode step's rows (in the graphs' pool) and the largest
    prefill pass's rows by its chunk's query blocks (in the eager allocator's)."""
    if not PAGED_MASKS[kind]:
        return 0
    return batch + prefill_rows(batch, max_len, kind) * ceil_div(min(max_len, PREFILL_CHUNK), MASK_QUERY_BLOCK)


def mask_token_bytes(max_len: int, batch: int, kind: str = "gpu") -> int:
    """What the block masks cost per position of the pool (rounded up to a byte): what each token
    of KV costs beside its keys and values."""
    return ceil_div(mask_rows(max_len, batch, kind) * MASK_BYTES_PER_BLOCK, KV_BLOCK_SIZE)


def mask_bytes(max_len: int, batch: int, pool_tokens: int, kind: str = "gpu") -> int:
    """The block masks over a pool of `pool_tokens` positions (`kv_pool_tokens`): the same
    per-position figure the KV cache's sizing divides by, so the two agree."""
    return mask_token_bytes(max_len, batch, kind) * pool_tokens


def gathered_kv_bytes(profile: ModelProfile, tp: int, max_len: int, batch: int, dtype: str = "auto",
                      kind: str = "gpu") -> int:
    """The keys and values the torch path copies out of the paged pool for one layer's attention
    (where `KV_GATHERED[kind]`): every row of the largest pass (`prefill_rows`), maxModelLen
    columns of its KV heads (the last prefill chunk, or a decode step at the longest context).
    Freed before the next layer's."""
    if not KV_GATHERED[kind]:
        return 0
    rows = prefill_rows(batch, max_len, kind)
    return 2 * rows * max_len * kv_heads_per_rank(profile.shape, tp) * profile.shape.head_dim \
        * profile.dtype_bytes(dtype)


def attention_workspace_bytes(profile: ModelProfile, tp: int, max_len: int, batch: int, dtype: str = "auto",
                              kind: str = "gpu") -> int:
    """What the worker's attention allocates beyond q/k/v when it needs a mask (padding, a sliding
    window, a prefill chunk after the first): the chunk's boolean mask and its additive copy in the
    runtime dtype, and, with several query heads per KV head, that copy repeated over the group (the
    queries are reshaped to [kv_heads, group * chunk]; the cached K/V are read in place, never
    expanded). A decode step's mask is one column and broadcast. Without a mask, SDPA's flash and
    memory-efficient kernels allocate no scores."""
    act = profile.dtype_bytes(dtype)
    heads, kv_heads = profile.shape.num_heads // tp, kv_heads_per_rank(profile.shape, tp)
    cells = prefill_rows(batch, max_len, kind) * min(max_len, PREFILL_CHUNK) * max_len
    grouped = cells * (heads // kv_heads) * act if heads > kv_heads else 0
    return cells * (1 + act) + grouped
