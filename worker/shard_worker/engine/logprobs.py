"""Log-probabilities a request asked for: of its prompt's tokens (echo), computed in its prefill,
and of each generated token with the most likely alternatives, computed where it was sampled.

The last stage computes them (`Extras.prompt` after each forward of a prefill unit, `Extras.sampled`
after each sampling) and keeps them by row; the first stage takes them with the tokens
(`Extras.take`). With one pipeline stage they are the same object; with several, the last stage
sends each emitting unit's as JSON right after its tokens (both ends know from the rows'
requests whether any row of the unit asked, so nothing is sent when none did).

The values are the model's own, log-softmax of its float32 logits (as OpenAI's and vLLM's are:
before temperature, penalties and filters).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shard_contract.wire import GenerateRequest

from .sampling import HostSampled


def wants(requests: Sequence[GenerateRequest | None]) -> bool:
    return any(q is not None and (q.logprobs is not None or q.prompt_logprobs) for q in requests)


class Extras:
    """Per row: the prompt's log-probabilities so far, and each sampled token's (with the top
    alternatives), not yet taken by the first stage."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, Any]] = {}

    def clear(self, row: int) -> None:
        self.rows.pop(row, None)

    def _row(self, row: int) -> dict[str, Any]:
        return self.rows.setdefault(row, {"prompt": [], "prompt_top": [], "sampled": []})

    def prompt(self, requests: Sequence[GenerateRequest | None], pads: torch.Tensor, r0: int, c0: int,
               hidden: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After the forward of a unit (rows from r0, columns from c0) on the last stage: the
        log-probability of each prompt token that a position of this unit predicts. Row r's
        prompt p lies in columns [pad, pad + len(p)); column c predicts column c + 1."""
        for i, request in enumerate(requests):
            if request is None or not request.prompt_logprobs:
                continue
            row, pad, n = r0 + i, int(pads[r0 + i]), len(request.prompt_ids)
            lo, hi = max(c0, pad), min(c0 + hidden.shape[1], pad + n - 1)  # positions predicting a prompt token
            entry = self._row(row)
            if c0 <= pad < c0 + hidden.shape[1]:
                entry["prompt"], entry["prompt_top"] = [None], [None]  # the first token: nothing predicts it
            if hi <= lo:
                continue
            lp = torch.log_softmax(logits(hidden[i, lo - c0:hi - c0]).float(), dim=-1)
            targets = torch.tensor(request.prompt_ids[lo + 1 - pad:hi + 1 - pad], device=lp.device)
            entry["prompt"] += lp.gather(1, targets[:, None])[:, 0].tolist()
            k = min(request.logprobs or 0, lp.shape[1])
            values, ids = lp.topk(k, dim=-1)
            entry["prompt_top"] += [list(zip(i_, v_, strict=True)) for i_, v_ in zip(ids.tolist(), values.tolist(),
                                                                                     strict=True)]

    def sampled(self, requests: Sequence[GenerateRequest | None], r0: int, host: HostSampled) -> None:
        """After a sampling step of rows from r0: each asking row's token log-probability and top."""
        if host.logprob is None or host.top is None:
            return
        for i, request in enumerate(requests):
            if request is not None and request.logprobs is not None:
                self._row(r0 + i)["sampled"].append((host.logprob[i], host.top[i][:request.logprobs]))

    def forget_sampled(self, row: int) -> None:
        """Row `row` starts sampling for its sequence: nothing sampled before counts."""
        entry = self.rows.get(row)
        if entry is not None:
            entry["sampled"] = []

    def unit(self, r0: int, r1: int) -> dict[int, dict[str, Any]]:
        """What rows [r0, r1) have gathered, removed: what the last stage sends back with a unit."""
        return {row: self.rows.pop(row) for row in range(r0, r1) if row in self.rows}

    def merge(self, got: dict[Any, dict[str, Any]]) -> None:
        """The first stage: what the last stage sent back (JSON turned the rows into strings)."""
        for row, entry in got.items():
            mine = self._row(int(row))
            mine["prompt"] += entry["prompt"]
            mine["prompt_top"] += [None if top is None else [tuple(t) for t in top] for top in entry["prompt_top"]]
            mine["sampled"] += [(lp, [tuple(t) for t in top]) for lp, top in entry["sampled"]]

    def take(self, row: int) -> dict[str, Any] | None:
        """The first stage, as row `row`'s sequence takes a token: its prompt's log-probabilities
        and that token's (a joiner's first token and its next may both be waiting)."""
        entry = self.rows.get(row)
        if entry is None:
            return None
        taken = {"prompt": entry["prompt"], "prompt_top": entry["prompt_top"], "sampled": entry["sampled"][:1]}
        entry["prompt"], entry["prompt_top"], entry["sampled"] = [], [], entry["sampled"][1:]
        if not entry["sampled"]:
            del self.rows[row]
        return taken
