"""The paged KV cache's scheduler and block pool, against a fake model, over random arrival orders.

The fake model's next token is a function of every token before it, read back through the
sequence's block table from a simulated KV store (one slot per block position holding the token
whose KV it would be). So a wrong block table, a prefix-cache block that holds another prompt's
tokens, a chunk computed twice or skipped, or a preempted sequence resumed wrongly changes the
answer, and every answer must equal what the sequence gives run alone through no cache at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard_worker.engine.kvblocks import BlockPool, block_hash, chain_hashes
from shard_worker.engine.scheduler import Scheduler, Seq
from shard_worker.model.paging import blocks_for

VOCAB = 50


def next_token(context: list[int]) -> int:
    """The fake model: depends on every token and its position."""
    h = 7
    for i, t in enumerate(context):
        h = (h * 31 + t * (i + 3)) % 1_000_003
    return h % VOCAB


def reference(prompt: list[int], new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(new):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


@dataclass
class Request:
    prompt: list[int]
    new: int
    arrive: int  # the step it arrives at
    cancel_at: int | None  # the step its client leaves at (None: never)


class FakeEngine:
    """Runs the scheduler's plans: writes each chunk's tokens into the KV slots of its blocks, and
    computes an emitting chunk's next token from what the block table reads back."""

    def __init__(self, scheduler: Scheduler):
        self.s = scheduler
        self.bs = scheduler.pool.block_size
        self.kv: list[int | None] = [None] * (scheduler.pool.num_blocks * self.bs)

    def step(self) -> list[tuple[Seq, int]]:
        plan = self.s.schedule()
        assert plan.tokens <= self.s.token_budget
        assert len(self.s.running) <= self.s.max_running
        emitted = []
        for chunk in plan.chunks:
            seq = chunk.seq
            assert chunk.start == seq.computed, "a chunk starts where the sequence's computed KV ends"
            assert len(seq.blocks) * self.bs >= chunk.end
            for p in range(chunk.start, chunk.end):
                self.kv[seq.slot(p, self.bs)] = seq.tokens[p]
            if chunk.emits:
                context = [self.kv[seq.slot(p, self.bs)] for p in range(chunk.end)]
                assert context == seq.tokens, "the block table reads back the sequence's own tokens"
                emitted.append((seq, next_token(context)))
        self.s.advance(plan)
        return emitted


def held_by_running(s: Scheduler) -> dict[int, int]:
    refs: dict[int, int] = {}
    for seq in s.running:
        for b in seq.blocks:
            refs[b] = refs.get(b, 0) + 1
    return refs


def simulate(requests: list[Request], num_blocks: int, block_size: int, max_running: int, budget: int,
             prefix_caching: bool) -> tuple[dict[int, list[int]], Scheduler]:
    s = Scheduler(BlockPool(num_blocks, block_size, prefix_caching), max_running, budget)
    engine = FakeEngine(s)
    seqs = {i: Seq(i, list(r.prompt), len(r.prompt), len(r.prompt) + r.new - 1) for i, r in enumerate(requests)}
    done: dict[int, list[int]] = {}
    step = 0
    while len(done) < len(requests):
        for i, r in enumerate(requests):
            if r.arrive == step:
                s.add(seqs[i])
            if r.cancel_at == step and i not in done and r.arrive <= step:
                s.remove(seqs[i])  # mid-prefill, mid-decode or still waiting
                done[i] = []
        for seq, token in engine.step():
            if seq.id in done:
                continue
            s.append(seq, token)
            if len(seq.tokens) - seq.prompt_len == requests[seq.id].new:
                s.remove(seq)
                done[seq.id] = seq.tokens[seq.prompt_len:]
        # No block is held by more sequences than hold it, none free while held, waiting hold none.
        assert held_by_running(s) == {b: s.pool.refs[b] for b in range(num_blocks) if s.pool.refs[b]}
        assert all(not w.blocks for w in s.waiting)
        assert s.pool.free_blocks == sum(1 for r in s.pool.refs if r == 0)
        step += 1
        assert step < 10_000, "every request that fits the cache alone finishes"
    return done, s


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    shared = draw(st.lists(st.integers(0, VOCAB - 1), max_size=24))  # a system prompt some share
    n = draw(st.integers(1, 8))
    requests = []
    for _ in range(n):
        prompt = (shared if draw(st.booleans()) else []) + draw(prompts)
        new = draw(st.integers(1, 12))
        cancel = draw(st.one_of(st.none(), st.integers(0, 30)))
        requests.append(Request(prompt, new, draw(st.integers(0, 20)), cancel))
    longest = max(len(r.prompt) + r.new - 1 for r in requests)
    num_blocks = draw(st.integers(blocks_for(longest, block_size), blocks_for(longest, block_size) * 4))
    return requests, num_blocks, block_size, draw(st.integers(1, 6)), draw(st.integers(1, 64)), draw(st.booleans())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_greedy_answers_equal_alone_under_any_arrival_order(workload):
    requests, num_blocks, block_size, max_running, budget, prefix_caching = workload
    done, s = simulate(requests, num_blocks, block_size, max_running, budget, prefix_caching)
    for i, r in enumerate(requests):
        cancelled = r.cancel_at is not None and r.cancel_at >= r.arrive and done[i] == []
        if not cancelled:
            assert done[i] == reference(r.prompt, r.new), f"request {i}"
    assert s.pool.free_blocks == num_blocks, "every block is released once all requests end"
    assert not s.running and not s.waiting


def test_preemption_by_recompute_gives_the_same_answers():
    """Four long requests in a cache that holds two of them: preempted, recomputed, all answered."""
    requests = [Request([i + 1] * 10, 20, 0, None) for i in range(4)]
    done, s = simulate(requests, num_blocks=blocks_for(29, 4) * 2, block_size=4, max_running=4, budget=64,
                       prefix_caching=False)
    assert s.preemptions > 0
    assert all(done[i] == reference(r.prompt, r.new) for i, r in enumerate(requests))


def test_a_shared_prefix_is_computed_once():
    system = list(range(1, 33))  # two full blocks of 16
    requests = [Request(system + [40 + i], 4, 0 if i == 0 else 10, None) for i in range(5)]
    done, s = simulate(requests, num_blocks=32, block_size=16, max_running=8, budget=512, prefix_caching=True)
    assert all(done[i] == reference(r.prompt, r.new) for i, r in enumerate(requests))
    assert (s.prefix_queries, s.prefix_hits) == (10, 8)  # the first misses both blocks, the others hit both


def test_the_last_prompt_token_is_always_computed():
    """A prompt of exactly one cached block still computes its last token (its logits are needed)."""
    prompt = list(range(16))
    requests = [Request(prompt, 2, 0, None), Request(prompt, 2, 5, None)]
    done, s = simulate(requests, num_blocks=8, block_size=16, max_running=2, budget=64, prefix_caching=True)
    assert done[0] == done[1] == reference(prompt, 2)
    assert s.prefix_hits == 0  # (16 - 1) // 16 = 0 usable blocks


def test_chunked_prefill_leaves_room_for_every_decode():
    """A long prompt joining running decodes takes only what the budget leaves after them."""
    s = Scheduler(BlockPool(64, 4), max_running=8, token_budget=8)
    shorts = [Seq(i, [i + 1], 1, 20) for i in range(4)]
    for seq in shorts:
        s.add(seq)
    plan = s.schedule()
    s.advance(plan)
    for seq in shorts:
        s.append(seq, 0)
    long = Seq(9, list(range(100)), 100, 110)
    s.add(long)
    for _ in range(5):
        plan = s.schedule()
        by_seq = {c.seq.id: c.count for c in plan.chunks}
        assert all(by_seq[i] == 1 for i in range(4)), "every running decode is in every step"
        assert by_seq.get(9, 0) <= 4
        s.advance(plan)
        for c in plan.chunks:
            if c.emits:
                s.append(c.seq, 0)


def test_a_request_that_cannot_fit_the_whole_cache_is_refused_and_others_wait():
    s = Scheduler(BlockPool(4, 4), max_running=4, token_budget=64)
    with pytest.raises(ValueError, match="blocks"):
        s.add(Seq(0, [1] * 10, 10, 17))
    big = Seq(1, [1] * 12, 12, 16)
    s.add(big)
    s.add(Seq(2, [2] * 4, 4, 8))
    plan = s.schedule()
    assert [c.seq.id for c in plan.chunks] == [1]  # the second waits for blocks, it does not fail
    assert len(s.waiting) == 1


def test_block_pool_lru_eviction_and_hashes():
    pool = BlockPool(3, 2)
    a = pool.allocate(2)
    keys = chain_hashes([1, 2, 3, 4], 2)
    assert keys[1] == block_hash(block_hash(b"", [1, 2]), [3, 4])
    assert chain_hashes([9, 2, 3, 4], 2)[1] != keys[1], "a block's key names everything before it"
    for block, key in zip(a, keys, strict=True):
        pool.cache(block, key)
    pool.release(a)
    assert pool.free_blocks == 3 and pool.cached_blocks == 2
    b = pool.allocate(1)  # the never-used block first, then the released tail before its head
    assert b is not None and b[0] not in a
    c = pool.allocate(1)
    assert c == [a[1]] and pool.cached_blocks == 1
    assert pool.lookup(keys) == [a[0]]  # the head survived, the tail was evicted
    with pytest.raises(ValueError):
        pool.release([a[1], a[1]])
