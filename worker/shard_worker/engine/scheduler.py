"""Which tokens each step computes: admission by free KV blocks, chunked prefill under a per-step
token budget, preemption by recompute, prefix reuse. Pure Python, no torch, no clock.

A step is a list of *chunks*: consecutive tokens [start, start + count) of one sequence whose
keys and values are computed (and written into its blocks) by one forward pass. A chunk that
reaches the end of the tokens the sequence knows *emits*: its last position's logits give the
sequence's next token. A decoding sequence's chunk is its one newest token; a prompt is computed
in chunks of what the budget leaves, beside the decodes.

Each step, in this order (vLLM's v1 scheduler is the model):
1. Every running sequence that is decoding gets its one token, oldest first.
2. Running sequences still in their prompt get the budget left, oldest first.
3. Waiting sequences are admitted first come, first served, while the budget, the cap on running
   sequences (`max_running`: the plan's maxBatchSize) and the free blocks allow. A newcomer's
   prompt first takes whatever full blocks the prefix cache holds for it (never the last prompt
   token: its logits are needed), then a chunk. The head of the queue that does not fit stops
   admission (no one overtakes it, so it cannot starve); it waits, it never fails.
When a running sequence needs a block and none is free, the newest running sequence is
*preempted*: its blocks are released and it goes back to the front of the queue, to be computed
again from its prompt and the tokens it generated (greedy output is unchanged: the same tokens
give the same next token). The oldest running sequence is never a victim while another runs, so
every request that fits the whole cache alone (`fits`) finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..model.paging import blocks_for
from .kvblocks import BlockPool, chain_hashes


@dataclass(eq=False)
class Seq:
    """One sequence: its tokens (prompt, then those generated), the KV blocks it holds (its block
    table, position p in block blocks[p // block_size]), and how many tokens' KV are computed."""

    id: int
    tokens: list[int]
    prompt_len: int
    max_tokens: int  # the most tokens whose KV it will hold (prompt + max new tokens - 1)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    keys: list[bytes] = field(default_factory=list)  # prefix keys of its full blocks of tokens
    registered: int = 0  # of its blocks, how many are offered to the prefix cache
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache gave it at its first admission
    admitted: bool = False

    def slot(self, position: int, block_size: int) -> int:
        """Where position `position`'s keys and values live: block * block_size + offset."""
        return self.blocks[position // block_size] * block_size + position % block_size


@dataclass(frozen=True)
class Chunk:
    seq: Seq
    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def emits(self) -> bool:
        return self.end == len(self.seq.tokens)


@dataclass
class StepPlan:
    chunks: list[Chunk]
    preempted: list[Seq]
    admitted: list[Seq]

    @property
    def tokens(self) -> int:
        return sum(c.count for c in self.chunks)


def decoding(seq: Seq) -> bool:
    """Its one newest token is all it has to compute (else: a prompt, or a preempted sequence's
    prompt and generated tokens, still to compute)."""
    return len(seq.tokens) - seq.computed == 1


class Scheduler:
    def __init__(self, pool: BlockPool, max_running: int, token_budget: int):
        if max_running < 1 or token_budget < 1:
            raise ValueError(f"max_running {max_running} and token_budget {token_budget} must be at least 1")
        self.pool, self.max_running, self.token_budget = pool, max_running, token_budget
        self.bs = pool.block_size
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # oldest admission first
        self.preemptions = 0
        self.prefix_queries = self.prefix_hits = 0  # prompt blocks looked up / found, at first admissions

    # ------------------------------------------------------------ requests
    def fits(self, max_tokens: int) -> bool:
        """Whether a sequence of `max_tokens` positions fits the whole cache alone (else it never runs)."""
        return blocks_for(max_tokens, self.bs) <= self.pool.num_blocks

    def add(self, seq: Seq) -> None:
        if not self.fits(seq.max_tokens):
            raise ValueError(f"{seq.max_tokens} tokens need {blocks_for(seq.max_tokens, self.bs)} blocks; the KV cache "
                             f"holds {self.pool.num_blocks}")
        self.waiting.append(seq)

    def remove(self, seq: Seq) -> None:
        """The sequence ends (finished, or cancelled at any point, mid-prefill too): its blocks are
        released, their computed full blocks staying in the prefix cache."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------ a step
    def schedule(self) -> StepPlan:
        budget = self.token_budget
        chunks: list[Chunk] = []
        preempted: list[Seq] = []
        admitted: list[Seq] = []
        # Running sequences, oldest first; a prompt's chunk leaves a token for each decode behind it.
        decodes = sum(1 for s in self.running if decoding(s))
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if decoding(seq):
                decodes -= 1
                n = min(1, budget)
            else:
                n = min(len(seq.tokens) - seq.computed, budget - decodes)
            if n <= 0:
                i += 1
                continue
            grown, victims = self._grow_or_preempt(seq, seq.computed + n)
            preempted += victims
            decodes -= sum(1 for v in victims if v is not seq and decoding(v))
            if not grown:
                break  # `seq` was the newest: nothing runs after it
            chunks.append(Chunk(seq, seq.computed, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_running and not preempted:
            seq = self.waiting[0]
            usable = (len(seq.tokens) - 1) // self.bs  # full blocks before the last known token
            self._extend_keys(seq)
            seq.blocks = self.pool.lookup(seq.keys[:usable])
            seq.registered = len(seq.blocks)
            seq.computed = len(seq.blocks) * self.bs
            # Leave a block for each running sequence's next one, so an admission does not
            # preempt at the next step; a prompt longer than what is free starts with a piece of it.
            room = (len(seq.blocks) + self.pool.free_blocks - len(self.running)) * self.bs - seq.computed
            n = min(len(seq.tokens) - seq.computed, budget, room)
            if n <= 0:
                self._release(seq)
                break
            got = self.pool.allocate(blocks_for(seq.computed + n, self.bs) - len(seq.blocks))
            assert got is not None
            seq.blocks += got
            if not seq.admitted:
                self.prefix_queries += usable
                self.prefix_hits += seq.computed // self.bs
                seq.cached_tokens, seq.admitted = seq.computed, True
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)
            chunks.append(Chunk(seq, seq.computed, n))
            budget -= n
        return StepPlan(chunks, preempted, admitted)

    def advance(self, plan: StepPlan) -> None:
        """The step ran: its chunks' KV are computed. Their new full blocks join the prefix cache."""
        for chunk in plan.chunks:
            seq = chunk.seq
            seq.computed = chunk.end
            self._extend_keys(seq)
            full = seq.computed // self.bs
            for b in range(seq.registered, full):
                self.pool.cache(seq.blocks[b], seq.keys[b])
            seq.registered = max(seq.registered, full)

    def append(self, seq: Seq, token: int) -> None:
        """An emitting chunk's sequence took its next token (the caller decides when it stops)."""
        seq.tokens.append(token)

    # ------------------------------------------------------------ helpers
    def _extend_keys(self, seq: Seq) -> None:
        parent = seq.keys[-1] if seq.keys else b""
        seq.keys += chain_hashes(seq.tokens, self.bs, parent, start=len(seq.keys))

    def _grow_or_preempt(self, seq: Seq, tokens: int) -> tuple[bool, list[Seq]]:
        """Blocks for `tokens` positions of a running `seq`, preempting the newest running
        sequences until they are free. Returns whether `seq` got them (False: it was preempted
        itself), and the sequences preempted."""
        need = blocks_for(tokens, self.bs) - len(seq.blocks)
        victims: list[Seq] = []
        while need > self.pool.free_blocks:
            victim = self.running.pop()
            self._preempt(victim)
            victims.append(victim)
            if victim is seq:
                return False, victims
        if need > 0:
            got = self.pool.allocate(need)
            assert got is not None
            seq.blocks += got
        return True, victims

    def _preempt(self, seq: Seq) -> None:
        self._release(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Seq) -> None:
        self.pool.release(seq.blocks)
        seq.blocks, seq.computed, seq.registered = [], 0, 0

