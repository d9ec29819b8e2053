"""The paged KV cache's bookkeeping: fixed-size blocks, their reference counts, and the prefix cache.

Pure Python, no torch: the leader decides with it (`preemption.py`, the batcher), and every rank's cache
holds the block ids it hands out. A block holds `block_size` consecutive tokens of one sequence
(in every layer and KV head of a rank). A *full* block whose KV has been computed is keyed by the
hash of its tokens chained to the hash of the block before it (so a key names the whole prefix up
to the block's end, as vLLM's and SGLang's do), and stays in the cache after its sequences end:
a later prompt that starts with the same tokens takes it instead of computing it again.

Blocks no sequence holds wait in one LRU queue, whether they carry a cached prefix or not; an
allocation takes the least recently released first, dropping its cache key then. So the prefix
cache costs no memory of its own: it is whatever the free blocks still hold.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ..model.paging import blocks_for

NONE_HASH = b""  # the parent of a sequence's first block


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: its tokens and every token before them (through `parent`). A
    cryptographic digest, so two prefixes that differ never share a block (Python's `hash` of a
    tuple collides on purpose-built inputs, and a collision here would serve another prompt's KV)."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()


def chain_hashes(tokens: Sequence[int], block_size: int, parent: bytes = NONE_HASH, start: int = 0) -> list[bytes]:
    """The keys of the full blocks of `tokens`, from block `start` on (whose parent key is `parent`)."""
    out = []
    for b in range(start, len(tokens) // block_size):
        parent = block_hash(parent, tokens[b * block_size:(b + 1) * block_size])
        out.append(parent)
    return out


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens; ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache needs at least one block of at least one token ({num_blocks} x {block_size})")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        self.key: list[bytes | None] = [None] * num_blocks  # a full block's prefix key, while cached
        self.cached: dict[bytes, int] = {}  # prefix key -> block
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self.hits = self.queries = 0  # prefix-cache lookups, in blocks

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take now (unheld, cached or not)."""
        return len(self.free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def cached_blocks(self) -> int:
        return len(self.cached)

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks for one sequence (each held once), or None when fewer are free: nothing taken."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._uncache(block)
            self.refs[block] = 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """A sequence lets go of its blocks (finished, cancelled or preempted). Given in its order,
        its last block enters the LRU queue first: a shared prefix's head outlives its tails."""
        for block in reversed(blocks):
            if self.refs[block] < 1:
                raise ValueError(f"block {block} released more often than it was held")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys`, now held by the caller once more each."""
        hit: list[int] = []
        if self.prefix_caching:
            for key in keys:
                block = self.cached.get(key)
                if block is None:
                    break
                hit.append(block)
            self.queries += len(keys)
            self.hits += len(hit)
        for block in hit:
            self.free.pop(block, None)
            self.refs[block] += 1
        return hit

    def cache(self, block: int, key: bytes) -> int:
        """Block `block` is full and computed, with prefix key `key`: later prompts may take it.
        Returns the block the key names: `block`, or one that already held the same prefix (the
        caller may keep using its own; the cache keeps the older one)."""
        if not self.prefix_caching:
            return block
        existing = self.cached.setdefault(key, block)
        if existing == block:
            self.key[block] = key
        return existing

    def _uncache(self, block: int) -> None:
        key = self.key[block]
        if key is not None:
            del self.cached[key]
            self.key[block] = None

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached.values()):
            self._uncache(block)


@dataclass
class Held:
    """A sequence's blocks (cache ids, in position order), its prompt's prefix keys (one a full
    block), and how many of its leading blocks are in the prefix cache: those it took from it
    (hits), then those it has offered since (each once its KV is written)."""

    blocks: list[int]
    keys: list[bytes]
    cached: int


class Blocks:
    """The engine's side of the pool: the blocks each cache row's sequence holds, its prompt's
    prefix keys, and the prefix cache's lookups and offers.

    A full prompt block is offered to the prefix cache as soon as the chunk that completes it has
    been computed (`written`), as vLLM does, not when the whole prompt is: a request sharing a long
    system prompt with one still being prefilled takes the blocks already done. (Down a pipeline
    the leader does not wait for the later stages: each stage runs its units in order, so whoever
    reads a block there runs after the chunk that wrote it.) A sequence preempted or cancelled
    mid-prompt has offered exactly its written blocks.

    A fixed batch reserves, at admission, every block a sequence may ever hold (`needed`: its
    prompt and every token it may generate). A continuous batch admits optimistically, as vLLM
    does: a sequence is given the blocks of its prompt and its first decode position (`admission`)
    and then one block at a time as it grows (`grow`); when none is free the engine preempts a
    sequence (`preempt`: its computed full blocks are offered to the prefix cache, then released),
    to be computed again later from its prompt and the tokens it generated.
    Only the leader (`decides`) holds a pool's references; elsewhere every call but `needed` and
    `admission` is a no-op (those ranks hear the leader's decisions)."""

    def __init__(self, num_blocks: int, block_size: int, decides: bool = True, prefix_caching: bool = True,
                 first_id: int = 0):
        self.pool = BlockPool(num_blocks, block_size, prefix_caching)
        self.block_size, self.decides = block_size, decides
        self.first_id = first_id  # the cache's id of the pool's block 0 (the cache reserves blocks before it)
        # Blocks kept free while sequences run (vLLM's watermark: 1%), so that an admission does not
        # preempt a running sequence at the next step.
        self.watermark = num_blocks // 100
        self.held: dict[int, Held] = {}  # row -> its sequence's blocks
        self.unplaced: list[Held] = []  # reserved, no row yet

    def needed(self, request) -> int:
        """Blocks a request holds at most while it runs (a prefix-cache hit takes fewer free ones)."""
        return blocks_for(len(request.prompt_ids) + request.max_new_tokens - 1, self.block_size)

    def admission(self, request) -> int:
        """Blocks a request of a continuous batch is admitted with (at most): its prompt's and its
        first decode step's position (none when its one token comes from the prefill)."""
        return blocks_for(len(request.prompt_ids) + min(request.max_new_tokens, 2) - 1, self.block_size)

    def room(self, running: bool = True) -> int:
        """Free blocks that admissions may take now: all of them when no sequence runs, else all
        but the watermark."""
        return max(0, self.pool.free_blocks - (self.watermark if running else 0))

    def reserve(self, request, optimistic: bool = False) -> tuple[list[int], int]:
        """The blocks of an admitted request (`needed`, or with `optimistic` its `admission`),
        its cached prompt blocks first (none when it asks for its prompt's log-probabilities:
        those are computed in its prefill), and its first own position. RuntimeError when too
        few are free (admission checks first)."""
        if not self.decides:
            raise RuntimeError("only the leader reserves KV blocks")
        prompt = request.prompt_ids
        keys = chain_hashes(prompt, self.block_size)
        usable = (len(prompt) - 1) // self.block_size  # never the last prompt token: its logits are needed
        want = self.admission(request) if optimistic else self.needed(request)
        hit = [] if request.prompt_logprobs else self.pool.lookup(keys[:usable])
        got = self.pool.allocate(want - len(hit))
        if got is None:
            self.pool.release(hit)
            raise RuntimeError(f"{want} KV blocks reserved with {self.pool.free_blocks} free")
        blocks = [b + self.first_id for b in hit + got]
        self.unplaced.append(Held(blocks, keys, len(hit)))
        return blocks, len(hit) * self.block_size

    def hold(self, row: int, blocks: list[int]) -> None:
        """The reservation `blocks` now belongs to `row`'s sequence."""
        for i, entry in enumerate(self.unplaced):
            if entry.blocks == list(blocks):
                self.held[row] = self.unplaced.pop(i)
                return

    def written(self, row: int, end: int) -> None:
        """`row`'s prompt is computed up to position `end` (a chunk ended there): its full blocks
        before it join the prefix cache (those not offered yet)."""
        entry = self.held.get(row)
        if entry is None:
            return
        upto = min(len(entry.keys), end // self.block_size)
        for b in range(entry.cached, upto):
            self.pool.cache(entry.blocks[b] - self.first_id, entry.keys[b])
        entry.cached = max(entry.cached, upto)

    def computed(self, rows) -> None:
        """The prompts of `rows` are prefilled on every rank: their full blocks join the prefix cache."""
        for row in rows:
            if row in self.held:
                self.written(row, len(self.held[row].keys) * self.block_size)

    def lacks(self, row: int, position: int) -> bool:
        """Whether `row`'s sequence holds no block for `position` yet (the leader's view)."""
        return row in self.held and position // self.block_size >= len(self.held[row].blocks)

    def grow(self, row: int) -> tuple[int, int] | None:
        """One more block for `row`'s sequence: (its index in the row's table, its cache id), or
        None when no block is free (nothing taken)."""
        got = self.pool.allocate(1)
        if got is None:
            return None
        blocks = self.held[row].blocks
        blocks.append(got[0] + self.first_id)
        return len(blocks) - 1, blocks[-1]

    def preempt(self, row: int, tokens: Sequence[int]) -> None:
        """`row`'s sequence lets go of its blocks, to be computed again: `tokens` are those whose
        KV it computed (its prompt and all but its newest generated token); its full blocks are
        offered to the prefix cache first, so its recompute may take them back."""
        entry = self.held.get(row)
        if entry is not None:
            keys = chain_hashes(tokens, self.block_size)
            for b in range(entry.cached, min(len(keys), len(entry.blocks))):
                self.pool.cache(entry.blocks[b] - self.first_id, keys[b])
        self.release(row)

    def release(self, row: int) -> None:
        entry = self.held.pop(row, None)
        if entry is not None:
            self.pool.release([b - self.first_id for b in entry.blocks])

    def release_all(self) -> None:
        for row in list(self.held):
            self.release(row)
        for entry in self.unplaced:
            self.pool.release([b - self.first_id for b in entry.blocks])
        self.unplaced.clear()
