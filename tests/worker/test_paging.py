"""The paged KV cache's pieces: the block tables expanded into slot maps (`model/paging.py`), the C
decode kernel reading a pool through them in place, the torch path and the fused layer giving the
same bits as over an unpaged cache, and the engine's reservations (`kvblocks.Blocks`)."""

from __future__ import annotations

import pytest
import torch

from shard_contract.wire import GenerateRequest
from shard_worker.engine.kvblocks import Blocks
from shard_worker.model import kernels
from shard_worker.model.paging import RESERVED_BLOCKS, TRASH_BLOCK, ZERO_BLOCK, captured_maps, slot_maps

BS = 4


def test_slot_maps_follow_the_block_table_past_the_padding():
    tables = torch.tensor([[7, 3, 9], [5, 2, TRASH_BLOCK]])
    pads, starts = torch.tensor([0, 3]), torch.tensor([0, 4])  # row 1: its first block came from the prefix cache
    reads, writes = slot_maps(tables, pads, starts, 2, 10, BS)
    # row 0, positions 0-9: blocks 7, 7, 7, 7, 3, ...; row 1: padding (ZERO) then positions 0-6
    assert reads[0].tolist() == [28, 29, 30, 31, 12, 13, 14, 15, 36, 37]
    assert reads[1].tolist() == [ZERO_BLOCK * BS] * 3 + [20, 21, 22, 23, 8, 9, 10]
    assert writes[0].tolist() == reads[0, 2:].tolist()
    # row 1: padding and the cached positions 0-3 go to TRASH, never into the shared block 5
    assert writes[1].tolist() == [TRASH_BLOCK * BS] * 5 + [8, 9, 10]


def test_captured_maps_are_the_decode_steps_slot_maps():
    tables = torch.tensor([[7, 3, 9], [5, 2, 6], [TRASH_BLOCK] * 3])
    pads = torch.tensor([0, 3, 1])
    for col in (3, 4, 8):
        reads, writes = captured_maps(tables, pads, torch.tensor([col]), 12, BS)
        want_reads, want_writes = slot_maps(tables, pads, torch.zeros(3, dtype=torch.int64), col, col + 1, BS)
        assert torch.equal(reads[:, :col + 1], want_reads) and torch.equal(writes, want_writes)
        assert bool((reads[:, col + 1:] == ZERO_BLOCK * BS).all())  # past the step: never stale values
    assert bool((writes[2] // BS == TRASH_BLOCK).all())  # a free row writes TRASH


def scattered_tables(rows: int, max_len: int, blocks: int, gen: torch.Generator) -> torch.Tensor:
    per_row = -(-max_len // BS)
    return RESERVED_BLOCKS + torch.randperm(blocks, generator=gen)[:rows * per_row].view(rows, per_row)


def paged(cache: torch.Tensor, tables: torch.Tensor, pads: torch.Tensor, cols: int, blocks: int) -> torch.Tensor:
    """An unpaged cache [rows, kv, max_len, hd] laid out in a pool [kv, slots, hd] through the block
    tables (left padding included; every slot nobody's column maps to is NaN, ZERO's zero)."""
    rows, kv, _, hd = cache.shape
    pool = torch.full((kv, (blocks + RESERVED_BLOCKS) * BS, hd), float("nan"), dtype=cache.dtype)
    pool[:, ZERO_BLOCK * BS:(ZERO_BLOCK + 1) * BS] = 0
    reads, _ = slot_maps(tables, pads, torch.zeros_like(pads), 0, cols, BS)
    for r in range(rows):
        for c in range(int(pads[r]), cols):
            pool[:, reads[r, c]] = cache[r, :, c]
    return pool


@pytest.mark.parametrize("level", kernels.LEVELS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_kernel_reads_a_pool_through_the_slots_as_an_unpaged_cache(level, dtype):
    """The same step over an unpaged cache and over a pool whose blocks are scattered (unused
    slots NaN): the same output bits, and the step's keys and values written where the write map
    says."""
    gen = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, hd, max_len, col = 3, 8, 2, 32, 40, 33
    qkv = torch.randn(rows, 1, (heads + 2 * kv_heads) * hd, generator=gen).to(dtype)
    angles = torch.rand(rows, 1, 1, hd // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    pads = torch.tensor([0, 5, 20])
    k = torch.randn(rows, kv_heads, max_len, hd, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, max_len, hd, generator=gen).to(dtype)
    tables = scattered_tables(rows, max_len, 64, gen)
    k_pool, v_pool = paged(k, tables, pads, col, 64), paged(v, tables, pads, col, 64)
    first = pads.clone()
    want = kernels.attend(qkv, cos, sin, k, v, first, col, heads, kv_heads, level=level)
    reads, writes = slot_maps(tables, pads, torch.zeros_like(pads), col, col + 1, BS)
    got = kernels.attend(qkv, cos, sin, k_pool, v_pool, first, col, heads, kv_heads, level=level, slots=reads,
                         wslots=writes)
    assert torch.equal(got, want)
    for r in range(rows):
        assert torch.equal(k_pool[:, writes[r, 0]], k[r, :, col]) and torch.equal(v_pool[:, writes[r, 0]], v[r, :, col])


def request(prompt: int, new: int, **kw) -> GenerateRequest:
    return GenerateRequest(prompt_ids=list(range(1, prompt + 1)), max_new_tokens=new, **kw)


def test_reservations_never_hand_out_the_reserved_blocks_and_share_cached_prompts():
    blocks = Blocks(num_blocks=10, block_size=BS, first_id=RESERVED_BLOCKS)
    a, start = blocks.reserve(request(9, 4))  # 12 positions: 3 blocks
    assert start == 0 and len(a) == 3 and min(a) >= RESERVED_BLOCKS
    blocks.hold(0, a)
    blocks.computed([0])  # its two full prompt blocks join the prefix cache
    b, start = blocks.reserve(request(9, 2))  # the same prompt: both full blocks from the cache
    assert start == 2 * BS and b[:2] == a[:2] and b[2] not in a
    blocks.hold(1, b)
    c, start = blocks.reserve(request(8, 1, prompt_logprobs=True))  # its prompt's log-probabilities: all computed
    assert start == 0 and not set(c) & set(a)
    blocks.hold(2, c)
    assert blocks.pool.free_blocks == 10 - 3 - 1 - 2
    blocks.release(0)
    assert blocks.pool.free_blocks == 5  # a's third block; the shared two are still held by b
    blocks.release_all()
    assert blocks.pool.free_blocks == 10 and blocks.pool.cached_blocks == 2
    assert blocks.pool.hits == 2 and blocks.pool.queries == 4


def test_a_reservation_that_does_not_fit_takes_nothing():
    blocks = Blocks(num_blocks=3, block_size=BS, first_id=RESERVED_BLOCKS)
    blocks.hold(0, blocks.reserve(request(4, 5))[0])  # 2 blocks
    with pytest.raises(RuntimeError):
        blocks.reserve(request(4, 5))
    assert blocks.pool.free_blocks == 1 and blocks.needed(request(4, 5)) == 2


def test_admission_waits_for_free_blocks_first_come_first_served():
    """The batcher's rules with the paged cache: a joiner must find its blocks free, and the first
    that does not stops those behind it (it waits; no one overtakes it); one whose new tokens do not
    fit the columns left is still passed over. A new batch takes what the free blocks hold, at least
    its head."""
    from shard_worker.serving.batcher import take_batch, take_joiners

    waiting = [request(4, 9), request(4, 17), request(4, 5), request(2, 2)]  # 3, 5, 2 and 1 blocks of 4
    needed = Blocks(num_blocks=100, block_size=BS).needed
    assert take_joiners(waiting, 4, 50, 64, needed, 6) == [0, 2, 3]  # 17 new tokens do not fit after column 50
    assert take_joiners(waiting, 4, 30, 64, needed, 6) == [0]  # it fits the column, not the blocks: it stops
    assert take_joiners(waiting, 4, 30, 64, needed, 8) == [0, 1]
    assert take_batch(waiting, 4, 64, needed, 7) == 1 and take_batch(waiting, 4, 64, needed, 10) == 3
    assert take_batch(waiting, 4, 64, needed, 0) == 1


def test_a_continuous_batch_admits_with_its_prompt_blocks_grows_and_preempts_into_the_prefix_cache():
    """Optimistic admission: a request is reserved its prompt's and first decode position's
    blocks, takes one more at a time (none when none is free: nothing taken), and a preempted
    sequence offers its computed full blocks to the prefix cache, where its recompute finds them."""
    blocks = Blocks(num_blocks=4, block_size=BS, first_id=RESERVED_BLOCKS)
    long = request(6, 20)  # 25 positions: 7 blocks at most, 2 to start with (6 prompt + 1)
    assert blocks.admission(long) == 2 and blocks.needed(long) == 7 and blocks.admission(request(8, 1)) == 2
    a, _ = blocks.reserve(long, optimistic=True)
    blocks.hold(0, a)
    assert not blocks.lacks(0, 7) and blocks.lacks(0, 8)
    assert blocks.grow(0) == (2, blocks.held[0].blocks[2]) and not blocks.lacks(0, 11)
    b, _ = blocks.reserve(request(3, 9), optimistic=True)  # 1 block (3 + 1 positions)
    blocks.hold(1, b)
    assert blocks.pool.free_blocks == 0 and blocks.grow(0) is None and blocks.room() == 0
    generated = [50, 51, 52, 53, 54, 55]  # 6 prompt + 6 generated tokens, the newest not computed
    blocks.preempt(0, long.prompt_ids + generated[:-1])  # 11 computed: two full blocks of 4
    assert blocks.pool.free_blocks == 3 and blocks.pool.cached_blocks == 2
    blocks.release(1)
    again = GenerateRequest(prompt_ids=long.prompt_ids + generated, max_new_tokens=14)
    c, start = blocks.reserve(again, optimistic=True)  # 12 + 1 positions: 4 blocks, 2 of them cached
    assert start == 2 * BS and c[:2] == a[:2] and blocks.pool.free_blocks == 0
    blocks.hold(0, c)
    blocks.release_all()
    assert blocks.pool.free_blocks == 4


def test_a_prompts_full_blocks_join_the_prefix_cache_as_its_chunks_write_them():
    """Chunked prefill: each full prompt block is offered once the chunk that completes it is
    computed (`written`), so a request sharing the prefix takes the blocks written so far; one
    preempted mid-prompt offers no more (the rest are not written), and its rejoin takes its own
    written blocks back."""
    blocks = Blocks(num_blocks=12, block_size=BS, first_id=RESERVED_BLOCKS)
    long = request(13, 2)  # 3 full blocks of 4 (and a 13th token)
    a, _ = blocks.reserve(long, optimistic=True)
    blocks.hold(0, a)
    blocks.written(0, 3)  # a chunk of 3 tokens: no block full yet
    assert blocks.pool.cached_blocks == 0
    blocks.written(0, 9)  # two blocks complete
    blocks.written(0, 9)  # (offered once)
    assert blocks.pool.cached_blocks == 2
    b, start = blocks.reserve(request(13, 4), optimistic=True)  # the same prompt, arriving mid-prompt
    assert start == 2 * BS and b[:2] == a[:2] and blocks.pool.hits == 2
    blocks.hold(1, b)
    blocks.preempt(0, [])  # mid-prompt: its third block is not written
    assert blocks.pool.cached_blocks == 2
    c, start = blocks.reserve(long, optimistic=True)  # it rejoins: its written blocks come back
    assert start == 2 * BS and c[:2] == a[:2]
    blocks.hold(0, c)
    blocks.written(0, 13)  # its prompt is done: the third block too
    assert blocks.pool.cached_blocks == 3
    blocks.release_all()
    assert blocks.pool.free_blocks == 12
