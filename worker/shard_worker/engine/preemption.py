"""The leader's KV-block orders at a continuous batch's step boundary: growth, preemption by
recompute, and who rejoins (vLLM's policy, in our left-padded batch of decode columns).

A continuous batch admits a request when the blocks of its prompt and first decode position are
free (`Blocks.admission`), not those of every token it may generate. At each step boundary every
running sequence, the longest running first, takes the block its next position needs; when none
is free, the newest running sequence is *preempted*: its computed full blocks are offered to the
prefix cache and its blocks released, and it waits at the front of those that rejoin. It rejoins
when a row, its blocks and the columns left allow, as a joiner whose prompt is its prompt and
the tokens it generated (`SequenceState.recompute`), for the new tokens it has left: the same
request index, the same stream (it just pauses), and, seeded sampling being a function of the
seed and the token's count (`sampling.py`), the same tokens it would have taken unpreempted.

The oldest running sequence is never preempted while another runs, so every request that fits the
cache alone (`Engine.check`) finishes; when nothing runs, the first preempted sequence rejoins
at once (the engine starts the columns again if those left are too few for it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shard_contract.wire import GenerateRequest

from .kvblocks import Blocks
from .sequences import Sequences, SequenceState


def fits_at(request: GenerateRequest, col: int, max_len: int) -> bool:
    """Whether `request` can join a running batch at decode column `col`: its prompt, left-padded,
    ends at `col` or, when it is longer, at its own length (the batch is reframed: `chunking.py`),
    and its new tokens fit before maxModelLen from there."""
    return max(len(request.prompt_ids), col) + request.max_new_tokens - 1 <= max_len


def grow(blocks: Blocks, seqs: Sequences, pads: torch.Tensor, col: int,
         apply: Callable[[list], None]) -> list[list]:
    """Every running sequence, the longest running first, takes the KV block its position at the
    decode column `col` needs; when none is free, the newest running sequence is preempted (itself
    if it is the newest). Each order is handed to `apply` as it is made (every rank replays them
    in that order), and all are returned: ["grow", row, index, block] and ["preempt", row]."""
    actions: list[list] = []
    by_age = seqs.by_age()
    for row in by_age:
        position = col - int(pads[row])
        while seqs.by_row[row] is not None and blocks.lacks(row, position):
            got = blocks.grow(row)
            if got is not None:
                actions.append(["grow", row, *got])
            else:
                victim = [r for r in by_age if seqs.by_row[r] is not None][-1]
                seq = seqs.by_row[victim]
                assert seq is not None
                # its KV is computed up to its newest token (the next decode step's input); a prompt
                # still computed in chunks offers no more: its chunks offered the blocks they
                # completed (Blocks.written), the rest are not written
                blocks.preempt(victim, [] if seq.prefilling else seq.request.prompt_ids + seq.tokens[:-1])
                actions.append(["preempt", victim])
            apply(actions[-1])
    return actions


def rejoining(seqs: Sequences) -> list[SequenceState]:
    """The preempted sequences still waiting to rejoin, in order (their clients may have left)."""
    return [seq for seq in seqs.preempted if not seq.finished]


def rejoin(blocks: Blocks, seqs: Sequences, col: int,
           max_len: int) -> list[tuple[GenerateRequest | None, tuple[list[int], int]]]:
    """The preempted sequences that rejoin at column `col`, in order, while rows and blocks are
    free and they fit the columns left (the first that does not stops the others), each as None
    (the next preempted sequence) with the blocks reserved for it and its first own position
    (its full blocks may come back from the prefix cache)."""
    chosen: list[tuple[GenerateRequest | None, tuple[list[int], int]]] = []
    free = len(seqs.free_rows())
    for seq in rejoining(seqs):
        request = seq.recompute()
        if len(chosen) == free or not fits_at(request, col, max_len) \
                or blocks.admission(request) > blocks.room(seqs.running() or bool(chosen)):
            break
        chosen.append((None, blocks.reserve(request, optimistic=True)))
    return chosen
