"""Generation: the leader's commands, and the life of one batch of requests on every rank.

The leader (rank 0) drives: `generate`, `reports`, `heartbeat` and `shutdown` each broadcast a
small JSON command to every rank, then do the leader's share. The other ranks sit in `follow()`,
running each command as it comes. An HTTP server is one more caller of the same leader methods.

Within a `generate`, the first stage owns the batch's state (tokens so far, which sequences
stopped) and decides each unit; the other stages follow the units (`runner.py`, `pipeline.py`).
The first stage's TP peers hold the same state because they receive the same tokens and apply the
same rules. A fixed batch (`shardctl generate`) needs no per-step message at all; a continuous
batch (the server) changes at each decode step boundary: who stops, grows, is preempted and joins
(`boundary.py`).

A sequence fails alone: a row whose token cannot be chosen comes back FAILED from every sampling
rank alike (`sampling.py`), and the first stage ends that sequence while the batch runs on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shard_contract.env import step_token_budget
from shard_contract.sharding import prefill_rows
from shard_contract.wire import Completion, GenerateRequest

from ..comm.dist import Comm
from ..model.model import Stage
from ..model.paging import RESERVED_BLOCKS
from ..model.step import KVCache, Rotary
from ..telemetry.accounting import Accounting
from . import grammar
from .boundary import Boundary, Hooks
from .chunking import Prefill
from .diagnosis import rows_summary
from .kvblocks import Blocks
from .pipeline import Unit, prefill_units
from .runner import Runner
from .sequences import Rows, Sequences, SequenceState


class RequestError(ValueError):
    """A request this group cannot run (too long, too many, unknown token ids...)."""


@dataclass
class Output:
    completions: list[Completion]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    decode_rows: int = 0  # rows the decode steps computed, summed over the steps
    logits: list[torch.Tensor] = field(default_factory=list)  # per generated position: [batch, vocab]


class Engine:
    def __init__(self, stage: Stage, cache: KVCache, comm: Comm, rotary: Rotary, acct: Accounting,
                 model_dir: str | Path, max_len: int, report: Callable[[], dict], step_tokens: int | None = None):
        self.stage, self.cache, self.comm, self.rotary, self.acct = stage, cache, comm, rotary, acct
        self.topo, self.config = comm.topo, stage.config
        self.model_dir, self.max_len, self.report = Path(model_dir), max_len, report
        self.last_generate: dict[str, float] = {}
        self.last_output: Output | None = None  # on first-stage ranks: what the latest generate produced
        # the per-step token budget of a continuous batch (decodes + joiners' prompt chunks:
        # chunking.py); the leader's, sent with each generate so that every rank composes alike
        self.step_tokens = step_tokens or step_token_budget(stage.device.type)
        # the most rows a prefill pass computes together: those the plan sized activations for
        # (a batch of up to maxBatchSize rows prefills in several passes, then decodes together)
        self.prefill_rows = prefill_rows(cache.batch, max_len, "gpu" if stage.device.type == "cuda" else "cpu")
        # The paged KV cache's bookkeeping (kvblocks.py): the leader's alone decides which blocks
        # each sequence holds; the other ranks hear it with the requests and joins.
        self.blocks = Blocks(cache.num_blocks, cache.block_size, decides=comm.topo.rank == 0,
                             first_id=RESERVED_BLOCKS)
        self.runner = Runner(stage, cache, comm, rotary, acct, self.blocks)  # this rank's share of a step
        self.boundary = Boundary(self.runner, comm, self.blocks, max_len)  # the first stage's step boundaries

    @property
    def preemptions(self) -> int:
        """The leader's: running sequences preempted for lack of KV blocks, ever."""
        return self.boundary.preemptions

    def grammars(self) -> grammar.Grammars | None:
        """The model's tokenizer for constrained decoding (built on the first request that needs it)."""
        return grammar.load(self.model_dir, self.config.vocab_size, tuple(self.config.eos_token_ids))

    # ------------------------------------------------------------ leader
    def check(self, request: GenerateRequest) -> None:
        """Refuse a request this group can never run, even alone. Reads no mutable state, so any
        thread may call it."""
        n = len(request.prompt_ids)
        if n + request.max_new_tokens - 1 > self.max_len:
            raise RequestError(f"prompt of {n} tokens + {request.max_new_tokens} new tokens exceeds maxModelLen "
                               f"{self.max_len}")
        if self.blocks.needed(request) > self.cache.num_blocks:
            raise RequestError(f"prompt of {n} tokens + {request.max_new_tokens} new tokens needs "
                               f"{self.blocks.needed(request)} KV blocks of {self.cache.block_size} tokens; this "
                               f"rank's KV cache holds {self.cache.num_blocks}")
        bad = [t for t in request.prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        if request.json_schema is not None:
            if not (self.model_dir / "tokenizer.json").is_file():
                raise RequestError(f"response_format needs {self.model_dir / 'tokenizer.json'}")
            try:
                grammar.grammar_of(request.json_schema)
            except ValueError as err:
                raise RequestError(str(err)) from None

    def validate(self, requests: list[GenerateRequest], optimistic: bool = False) -> None:
        if len(requests) > self.cache.batch:
            raise RequestError(f"{len(requests)} sequences; this group's KV cache holds {self.cache.batch} "
                               "(maxBatchSize)")
        longest = max(len(r.prompt_ids) for r in requests)
        for i, r in enumerate(requests):
            try:
                self.check(r)
            except RequestError as err:
                raise RequestError(f"request {i}: {err}") from None
            if longest + r.max_new_tokens - 1 > self.max_len:
                raise RequestError(f"request {i}: prompt of {len(r.prompt_ids)} tokens (the batch is padded to "
                                   f"{longest}) + {r.max_new_tokens} new tokens exceeds maxModelLen {self.max_len}")
        need = sum(self.blocks.admission(r) if optimistic else self.blocks.needed(r) for r in requests)
        if need > self.blocks.pool.free_blocks:
            raise RequestError(f"{len(requests)} sequences need {need} KV blocks; {self.blocks.pool.free_blocks} of "
                               f"this rank's {self.cache.num_blocks} are free")

    def generate(self, requests: list[GenerateRequest], return_logits: bool = False,
                 hooks: Hooks | None = None) -> Output:
        """Run `requests` as one batch. With `hooks` (the server) the batch is continuous: others
        join it as rows free up (see `Hooks`), and each sequence is handed to `hooks.finished` when
        it stops; the generate ends when every sequence has stopped and none joins. A fixed batch
        holds every KV block its sequences may need from the start; a continuous one takes them as
        its sequences grow, preempting the newest when none is free (`preemption.py`)."""
        self.validate(requests, optimistic=hooks is not None)
        if hooks is not None and return_logits:
            raise ValueError("logits are returned for a fixed batch only")
        places = [self.blocks.reserve(r, optimistic=hooks is not None) for r in requests]
        self.comm.broadcast_json({"op": "generate", "requests": [r.model_dump() for r in requests],
                                  "places": places, "return_logits": return_logits, "continuous": hooks is not None,
                                  "step_tokens": self.step_tokens})
        out = self._generate(requests, places, return_logits, hooks, continuous=hooks is not None)
        assert out is not None
        return out

    def reports(self) -> list[dict]:
        """Every rank's report (see `RankReport`), in rank order."""
        self.comm.broadcast_json({"op": "report"})
        reports = self.comm.gather_json(self.report())
        assert reports is not None  # the leader asks
        return reports

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
            try:
                self._follow(command)
            except Exception as err:
                err.add_note(f"rank {self.topo.rank} was following the leader's {op!r} command")
                raise

    def _follow(self, command: dict[str, Any]) -> None:
        op = command["op"]
        if op == "generate":
            requests = [GenerateRequest.model_validate(r) for r in command["requests"]]
            places = [(list(b), int(st)) for b, st in command["places"]]
            self.step_tokens = int(command["step_tokens"])
            self._generate(requests, places, command["return_logits"], continuous=command["continuous"])
        elif op == "report":
            self.comm.gather_json(self.report())
        elif op != "noop":
            raise RuntimeError(f"unknown command {op!r} from the leader")

    # ------------------------------------------------------------ every rank
    def _generate(self, requests: list[GenerateRequest], places: list[tuple[list[int], int]], return_logits: bool,
                  hooks: Hooks | None = None, continuous: bool = False) -> Output | None:
        start, before = time.perf_counter(), self.acct.snapshot()
        prompt_cols = max(len(r.prompt_ids) for r in requests)
        self.runner.begin(prompt_cols)
        rows = Rows(self.cache.batch, sampler=self.topo.is_last, grammars=self.grammars,
                    blocks_per_row=self.cache.blocks_per_row)
        try:
            for row, (r, (blocks, first)) in enumerate(zip(requests, places, strict=True)):
                rows.place(row, r, prompt_cols - len(r.prompt_ids), blocks, first)
                self.blocks.hold(row, blocks)
            with torch.inference_mode():
                if self.topo.is_first:
                    out = self._drive(requests, rows, return_logits, hooks, continuous)
                else:
                    self.runner.relay(rows, return_logits)
                    out = None
                self.runner.link.flush()
        except Exception as err:  # the rank's log names the requests it held (`diagnosis.py`)
            err.add_note(f"rank {self.topo.rank} (stage {self.topo.stage}) was running a generate:\n"
                         f"{rows_summary(rows)}")
            raise
        finally:
            self.blocks.release_all()  # the leader's: every sequence of this generate has ended
        after, end = self.acct.snapshot(), time.perf_counter()
        self.last_generate = {"seconds": end - start, **after.minus(before).summary()}
        if self.runner.decode_mark is not None:  # the same figures for the decode steps alone
            mark_time, mark = self.runner.decode_mark
            decode = after.minus(mark).summary()
            self.last_generate.update({"decode_seconds": end - mark_time,
                                       **{f"decode_{k}": v for k, v in decode.items()}})
        if out is not None:  # the first stage counts the steps: with them, the time of one step
            self.last_generate["decode_steps"] = out.decode_steps
        self.last_output = out
        return out

    def _drive(self, requests: list[GenerateRequest], rows: Rows, return_logits: bool, hooks: Hooks | None,
               continuous: bool) -> Output:
        """The first stage: prefill, then one decode unit per step until every sequence stops
        (with, when continuous, the prefills of those that join at each step before it)."""
        start = time.perf_counter()
        vocab = self.config.vocab_size if return_logits else None
        seqs = Sequences(self.cache.batch, self.config.eos_token_ids, self.stage.device)
        out = Output(completions=[], prefill_seconds=0.0, decode_seconds=0.0, decode_steps=0)
        for row, r in enumerate(requests):
            seqs.start(row, r).cached_tokens = int(rows.starts[row])
        first = list(range(len(requests)))
        tokens, logits = self._prefill(requests, rows, vocab)
        self.blocks.computed(range(len(requests)))
        out.logits += [logits.cpu()] if logits is not None else []
        out.prefill_seconds = time.perf_counter() - start
        seqs.feed(first, tokens)
        self._report(seqs.add(first, tokens.tolist(), rows.failures, rows.extras), hooks)

        col, prefills = self.runner.prompt_cols, list[Prefill]()
        while seqs.live():
            col, joined, join_tokens = self.boundary.join(seqs, rows, col, prefills, hooks, continuous,
                                                          self.step_tokens)
            if not seqs.live():  # every client left, and nobody joined
                self.runner.flush(rows)
                break
            # Rows outside the decoding ones are not computed (a CPU matmul of 4 rows can cost
            # twice one row's); logits are returned for every row of a fixed batch.
            span = (0, rows.used) if return_logits else seqs.live_span()
            if span is None:  # every running sequence's prompt is still being computed
                self.runner.flush(rows)
                continue
            lo, hi = span
            unit = Unit(lo, hi, col, col + 1, emits=True)
            tokens, logits = self.runner.run([(unit, seqs.next_tokens[lo:hi].view(hi - lo, 1))], rows, vocab)
            out.logits += [logits.cpu()] if logits is not None else []
            seqs.feed(slice(lo, hi), tokens)  # the next step's input ids, on the device
            took = seqs.add(joined, join_tokens, rows.failures, rows.extras) + \
                seqs.add(list(range(lo, hi)), tokens.tolist(), rows.failures, rows.extras)
            self._report(list(dict.fromkeys(took)), hooks)  # a joiner took two tokens: report it once
            col += 1
            out.decode_steps += 1
            out.decode_rows += hi - lo
        self.runner.flush(rows)
        self.runner.stop()
        out.decode_seconds = time.perf_counter() - start - out.prefill_seconds
        out.completions = [s.completion() for s in seqs.all]
        return out

    def _prefill(self, requests: list[GenerateRequest], rows: Rows,
                 vocab: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first batch's prompts, left-padded to the longest, in micro-batches and chunks."""
        prompt_cols = self.runner.prompt_cols
        ids = torch.zeros(len(requests), prompt_cols, dtype=torch.int64)
        for i, r in enumerate(requests):
            ids[i, int(rows.pads[i]):] = torch.tensor(r.prompt_ids)
        # what every row took from the prefix cache is not computed again (when all of them took some)
        c0 = int((rows.pads + rows.starts)[:len(requests)].min())
        units = prefill_units((0, len(requests)), (c0, prompt_cols), self.topo.pp, max_rows=self.prefill_rows)
        return self.runner.run([(u, ids[u.r0:u.r1, u.c0:u.c1]) for u in units], rows, vocab)

    def _report(self, took: list[SequenceState], hooks: Hooks | None) -> None:
        """Tell the batcher (on the leader) which sequences took a token, and which stopped."""
        if hooks is None:
            return
        hooks.step(took)
        for seq in took:
            if seq.finished:
                hooks.finished(seq, seq.completion())
