"""Choosing the next token from logits: greedy, or temperature + top-p with a seeded generator
per sequence.

Every TP rank of the last stage holds bit-identical gathered logits and a generator seeded the
same way, so they all choose the same tokens without exchanging them, and a row whose sampling
fails fails the same way on each of them: it gets the token FAILED, and the first stage ends
that sequence alone (the group runs on).

Sampling is numerically safe over every accepted value (temperature in (0, 2], top_p in (0, 1]):
it works in float64 on logits shifted so that the most likely token's is 0, so a temperature of
1e-40 still gives a distribution (the most likely tokens alone, as its limit does), and top_p is
compared in float64 (1e-300 is 0 in float32), the most likely token always kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shard_contract.wire import GenerateRequest

from .log import first_line

FAILED = -1  # the token of a row whose sampling raised


def generator(request: GenerateRequest) -> torch.Generator | None:
    """The seeded generator a sampling request draws from; None for a greedy one."""
    return torch.Generator().manual_seed(request.seed) if request.temperature > 0 else None


def top_p_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Probabilities [V] (float64) of one row after temperature, restricted to the smallest set
    of most likely tokens whose mass reaches `top_p` (renormalised)."""
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("the model's logits for this sequence are not finite")
    shifted = logits.double() - logits.max().double()  # <= 0; 0 for the most likely token
    probs = (shifted / temperature).exp()  # exp(0) = 1: the sum is at least 1, never 0 or inf
    probs /= probs.sum()
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens; 0 for the first
    sorted_probs[before >= top_p] = 0.0
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()


def choose(logits: torch.Tensor, requests: Sequence[GenerateRequest | None],
           gens: Sequence[torch.Generator | None]) -> tuple[torch.Tensor, dict[int, str]]:
    """Next token ids [rows] for logits [rows, V]; row i follows requests[i] and gens[i] (greedy
    where gens[i] is None). A row whose sampling raises gets FAILED; returns the tokens and, by
    row, why those rows failed."""
    tokens = logits.argmax(dim=-1)
    failed: dict[int, str] = {}
    if all(g is None for g in gens):
        return tokens, failed
    for i, (request, gen) in enumerate(zip(requests, gens, strict=False)):
        if gen is None or request is None:
            continue
        try:
            probs = top_p_probs(logits[i].cpu(), request.temperature, request.top_p)
            tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
        except Exception as err:  # noqa: BLE001 -- this row's request fails, not the group
            tokens[i] = FAILED
            failed[i] = f"choosing its next token failed: {first_line(err)}"
    return tokens, failed
