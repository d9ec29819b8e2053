"""Generation: the leader's commands, and the loop every rank runs for one batch of requests.

The leader (rank 0) drives: `generate`, `reports`, `heartbeat` and `shutdown` each broadcast a
small JSON command to every rank, then do the leader's share. The other ranks sit in `follow()`,
running each command as it comes. An HTTP server is one more caller of the same leader methods.

Within a `generate`, the first stage owns the batch's state (tokens so far, which sequences
stopped) and decides each unit; the other stages follow the units (see `pipeline.py`). The first
stage's TP peers hold the same state because they receive the same tokens and apply the same
rules, so no rank waits for a per-step command.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from shard_operator.workerenv import Completion, GenerateRequest

from .accounting import Accounting
from .dist import Comm
from .model import KVCache, Rotary, Stage, Step
from .pipeline import Link, Unit, prefill_units
from .sampling import choose, generators


class RequestError(ValueError):
    """A request this group cannot run (too long, too many, unknown token ids...)."""


class SequenceState:
    """One sequence's generated tokens and whether (and why) it has stopped."""

    def __init__(self, request: GenerateRequest, eos_ids: tuple[int, ...]):
        self.request = request
        self.stop_ids = set(request.stop_token_ids) | (set() if request.ignore_eos else set(eos_ids))
        self.tokens: list[int] = []
        self.finish_reason: str | None = None

    def add(self, token: int, tokenizer: Any) -> None:
        if self.finish_reason is not None:
            return
        self.tokens.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.request.stop and _find_stop(tokenizer.decode(self.tokens), self.request.stop) is not None:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.request.max_new_tokens:
            self.finish_reason = "length"

    def completion(self, tokenizer: Any) -> Completion:
        text = None
        if tokenizer is not None:
            text = tokenizer.decode(self.tokens)
            cut = _find_stop(text, self.request.stop)
            text = text if cut is None else text[:cut]
        return Completion(token_ids=self.tokens, text=text, finish_reason=self.finish_reason or "length")


def _find_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


OnStep = Callable[[list[SequenceState]], None]


@dataclass
class Output:
    completions: list[Completion]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    logits: list[torch.Tensor] = field(default_factory=list)  # per generated position: [batch, vocab]


class Engine:
    def __init__(self, stage: Stage, cache: KVCache, comm: Comm, rotary: Rotary, acct: Accounting,
                 model_dir: str | Path, max_len: int, report: Callable[[], dict]):
        self.stage, self.cache, self.comm, self.rotary, self.acct = stage, cache, comm, rotary, acct
        self.topo, self.config = comm.topo, stage.config
        self.model_dir, self.max_len, self.report = Path(model_dir), max_len, report
        self.link = Link(comm, self.config.hidden_size, stage.dtype, stage.device)
        self.last_generate: dict[str, float] = {}
        self.last_output: Output | None = None  # on first-stage ranks: what the latest generate produced
        self._prompt_cols, self._decode_mark = 0, None
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        """tokenizer.json of the model directory, or None (text output and stop strings need it)."""
        path = self.model_dir / "tokenizer.json"
        if self._tokenizer is None and path.is_file():
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(path))
        return self._tokenizer

    # ------------------------------------------------------------ leader
    def validate(self, requests: list[GenerateRequest]) -> None:
        if len(requests) > self.cache.batch:
            raise RequestError(f"{len(requests)} sequences; this group's KV cache holds {self.cache.batch} "
                               "(maxBatchSize)")
        longest = max(len(r.prompt_ids) for r in requests)
        for i, r in enumerate(requests):
            if longest + r.max_new_tokens - 1 > self.max_len:
                raise RequestError(f"request {i}: prompt of {len(r.prompt_ids)} tokens (the batch is padded to "
                                   f"{longest}) + {r.max_new_tokens} new tokens exceeds maxModelLen {self.max_len}")
            bad = [t for t in r.prompt_ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise RequestError(f"request {i}: token ids {bad[:5]} are outside the vocabulary "
                                   f"[0, {self.config.vocab_size})")
            if r.stop and self.tokenizer is None:
                raise RequestError(f"request {i}: stop strings need {self.model_dir / 'tokenizer.json'}")

    def generate(self, requests: list[GenerateRequest], return_logits: bool = False,
                 on_step: OnStep | None = None) -> Output:
        """Run `requests` as one batch. `on_step(sequences)` is called on this rank after each
        step's tokens are added (the server streams from it); it must not block."""
        self.validate(requests)
        self.comm.broadcast_json({"op": "generate", "requests": [r.model_dump() for r in requests],
                                  "return_logits": return_logits})
        out = self._generate(requests, return_logits, on_step)
        assert out is not None
        return out

    def reports(self) -> list[dict]:
        """Every rank's report (see `RankReport`), in rank order."""
        self.comm.broadcast_json({"op": "report"})
        return self.comm.gather_json(self.report())

    def heartbeat(self) -> None:
        """Keep the followers' collective timeout from expiring while there is no work."""
        self.comm.broadcast_json({"op": "noop"})

    def shutdown(self) -> None:
        self.comm.broadcast_json({"op": "shutdown"})

    # ------------------------------------------------------------ followers
    def follow(self) -> None:
        """Run the leader's commands until it says shutdown."""
        while True:
            command = self.comm.broadcast_json()
            op = command["op"]
            if op == "shutdown":
                return
            if op == "generate":
                requests = [GenerateRequest.model_validate(r) for r in command["requests"]]
                self._generate(requests, command["return_logits"])
            elif op == "report":
                self.comm.gather_json(self.report())
            elif op != "noop":
                raise RuntimeError(f"unknown command {op!r} from the leader")

    # ------------------------------------------------------------ every rank
    def _generate(self, requests: list[GenerateRequest], return_logits: bool,
                  on_step: OnStep | None = None) -> Output | None:
        start, before = time.perf_counter(), self.acct.counters.copy()
        prompt_cols = max(len(r.prompt_ids) for r in requests)
        self._prompt_cols, self._decode_mark = prompt_cols, None
        pads = torch.tensor([prompt_cols - len(r.prompt_ids) for r in requests], dtype=torch.int64)
        with torch.inference_mode():
            if self.topo.is_first:
                out = self._drive(requests, pads, prompt_cols, return_logits, on_step)
            else:
                self._relay(requests, pads, prompt_cols, return_logits)
                out = None
            self.link.flush()
        end = time.perf_counter()
        self.last_generate = {"seconds": end - start, **self.acct.counters.minus(before).summary()}
        if self._decode_mark is not None:  # the same figures for the decode steps alone
            mark_time, mark = self._decode_mark
            decode = self.acct.counters.minus(mark).summary()
            self.last_generate.update({"decode_seconds": end - mark_time,
                                       **{f"decode_{k}": v for k, v in decode.items()}})
        self.last_output = out
        return out

    def _forward(self, unit: Unit, x: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
        if self._decode_mark is None and unit.c0 >= self._prompt_cols:  # the first decode step
            self._decode_mark = (time.perf_counter(), self.acct.counters.copy())
        with self.acct.computing():
            step = Step.build(unit.r0, unit.r1, unit.c0, unit.c1, pads, self.rotary, self.stage.windows,
                              self.stage.dtype, self.stage.device)
            return self.stage.forward(x, step, self.cache)

    def _sample(self, unit: Unit, hidden: torch.Tensor, requests: list[GenerateRequest], gens: list,
                return_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self.acct.computing():
            logits = self.stage.logits(hidden[:, -1])
            tokens = choose(logits, requests[unit.r0:unit.r1], gens[unit.r0:unit.r1])
        return tokens, (logits if return_logits else None)

    def _drive(self, requests: list[GenerateRequest], pads: torch.Tensor, prompt_cols: int,
               return_logits: bool, on_step: OnStep | None = None) -> Output:
        """The first stage: prefill, then one decode unit per step until every sequence stops."""
        start = time.perf_counter()
        batch, last, device = len(requests), self.topo.is_last, self.stage.device
        vocab = self.config.vocab_size if return_logits else None
        ids = torch.zeros(batch, prompt_cols, dtype=torch.int64)
        for i, r in enumerate(requests):
            ids[i, int(pads[i]):] = torch.tensor(r.prompt_ids)
        ids = ids.to(device)
        gens = generators(requests) if last else []
        seqs = [SequenceState(r, self.config.eos_token_ids) for r in requests]
        tokenizer = self.tokenizer if any(r.stop for r in requests) else None
        out = Output(completions=[], prefill_seconds=0.0, decode_seconds=0.0, decode_steps=0)

        emitted: list[tuple[Unit, torch.Tensor, torch.Tensor | None]] = []
        units = prefill_units(batch, prompt_cols, self.topo.pp)
        for unit in units:
            hidden = self._forward(unit, ids[unit.r0:unit.r1, unit.c0:unit.c1], pads)
            if not last:
                self.link.send_unit(unit, hidden)
            elif unit.emits(prompt_cols):
                emitted.append((unit, *self._sample(unit, hidden, requests, gens, return_logits)))
        if not last:
            emitted = [(u, *self.link.recv_tokens(u.rows, vocab)) for u in units if u.emits(prompt_cols)]
        emitted.sort(key=lambda e: e[0].r0)
        tokens = torch.cat([t for _, t, _ in emitted])
        if return_logits:
            out.logits.append(torch.cat([lg for _, _, lg in emitted]).cpu())
        out.prefill_seconds = time.perf_counter() - start

        col = prompt_cols
        while True:
            for seq, token in zip(seqs, tokens.tolist()):
                seq.add(token, tokenizer)
            if on_step is not None:
                on_step(seqs)
            if all(s.finish_reason is not None for s in seqs):
                break
            unit = Unit(0, batch, col, col + 1)
            hidden = self._forward(unit, tokens.view(batch, 1).to(device), pads)
            if last:
                tokens, logits = self._sample(unit, hidden, requests, gens, return_logits)
            else:
                self.link.send_unit(unit, hidden)
                tokens, logits = self.link.recv_tokens(batch, vocab)
            if return_logits:
                out.logits.append(logits.cpu())
            col += 1
            out.decode_steps += 1
        if not last:
            self.link.send_stop()
        out.decode_seconds = time.perf_counter() - start - out.prefill_seconds
        final_tokenizer = self.tokenizer if self.topo.is_leader else tokenizer
        out.completions = [s.completion(final_tokenizer) for s in seqs]
        return out

    def _relay(self, requests: list[GenerateRequest], pads: torch.Tensor, prompt_cols: int,
               return_logits: bool) -> None:
        """A later stage: run each unit as it arrives; the last stage sends tokens back."""
        gens = generators(requests) if self.topo.is_last else []
        while (got := self.link.recv_unit()) is not None:
            unit, hidden = got
            hidden = self._forward(unit, hidden, pads)
            if not self.topo.is_last:
                self.link.send_unit(unit, hidden)
            elif unit.emits(prompt_cols):
                self.link.send_tokens(*self._sample(unit, hidden, requests, gens, return_logits))
        if not self.topo.is_last:
            self.link.send_stop()
