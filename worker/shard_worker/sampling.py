"""Choosing the next token from float32 logits: greedy, or temperature + top-p with a seeded
generator per sequence.

Every TP rank of the last stage holds bit-identical gathered logits and a generator seeded the
same way, so they all choose the same tokens without exchanging them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from shard_contract.wire import GenerateRequest


def generators(requests: Sequence[GenerateRequest]) -> list[torch.Generator | None]:
    return [torch.Generator().manual_seed(r.seed) if r.temperature > 0 else None for r in requests]


def top_p_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Probabilities [V] of one row after temperature, restricted to the smallest set of most
    likely tokens whose mass reaches `top_p` (renormalised)."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens
    sorted_probs[before >= top_p] = 0.0  # the most likely token always stays (before = 0)
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()


def choose(logits: torch.Tensor, requests: Sequence[GenerateRequest],
           gens: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Next token ids [rows] for logits [rows, V]; row i follows requests[i] and gens[i]."""
    greedy = logits.argmax(dim=-1)
    if all(g is None for g in gens):
        return greedy
    out = greedy.clone()
    for i, (request, gen) in enumerate(zip(requests, gens)):
        if gen is not None:
            probs = top_p_probs(logits[i].cpu(), request.temperature, request.top_p)
            out[i] = int(torch.multinomial(probs, 1, generator=gen))
    return out
