"""Generation: the leader's commands, and the loop every rank runs for one batch of requests.

The leader (rank 0) drives: `generate`, `reports`, `heartbeat` and `shutdown` each broadcast a
small JSON command to every rank, then do the leader's share. The other ranks sit in `follow()`,
running each command as it comes. An HTTP server is one more caller of the same leader methods.

Within a `generate`, the first stage owns the batch's state (tokens so far, which sequences
stopped) and decides each unit; the other stages follow the units (see `pipeline.py`). The first
stage's TP peers hold the same state because they receive the same tokens and apply the same
rules. A fixed batch (`shardctl generate`) needs no per-step message at all. A continuous batch
(the server) lets requests join at each decode step boundary, into the rows of finished (or
cancelled: their clients hung up) sequences, their prompts computed a chunk a step beside the
running decodes within a per-step token budget (`chunking.py`): the leader's batcher chooses
them, and the leader tells its first-stage TP peers who joins and who is cancelled at every step, with one small
message (an empty one costs a shared-memory round where the peers share a machine, else one
gloo broadcast); the later stages learn of each join from a JOIN header in the pipeline. A
continuous batch's sequences take KV blocks as they grow, and when none is free the newest is
preempted, to rejoin later from its prompt and the tokens it generated (`preemption.py`): those
orders ride in the same message, and down the pipeline as GROW and FREE headers.

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
from shard_contract.wire import Completion, GenerateRequest

from ..comm.dist import Comm
from ..log import log
from ..model.model import KVCache, Rotary, Stage, Step
from ..model.paging import RESERVED_BLOCKS, TRASH_BLOCK
from ..telemetry.accounting import Accounting, Counters
from . import grammar, logprobs
from .chunking import Prefill, plan_step
from .graphs import DecodeGraphs, chosen_mode
from .kvblocks import Blocks
from .pipeline import Free, Grow, Join, Link, Pads, Unit, chunk_units, prefill_units
from .preemption import fits_at, grow, rejoin, rejoining
from .sequences import PARKED, Rows, Sequences, SequenceState


class RequestError(ValueError):
    """A request this group cannot run (too long, too many, unknown token ids...)."""


@dataclass
class Hooks:
    """What a continuous generate asks of the leader's batcher, on the engine thread; none may block.

    admit(free_rows, col): the requests that join the running batch at decode column `col` now,
    at most `free_rows`, in order; each must fit (`fits_at`). step(sequences): the sequences that
    took a token in a step (the first batch's prefill, or one decode step with the joiners whose
    prompts ended in it). finished(sequence,
    completion): a sequence has stopped (finish_reason "error": it failed alone, the batch runs on);
    its row is free from the next step on. cancelled(): the sequences (by index) whose clients have
    gone since the last call: they stop at this step boundary, unanswered, and their rows are free
    for those who join at it. stopped(): the sequences (by index) whose text met a stop string (the
    leader's text side finds them, `text.py`): they stop at this step boundary with finish reason
    "stop" and are handed to `finished`; their rows are free as the cancelled ones' are.
    """

    admit: Callable[[int, int], list[GenerateRequest]]
    step: Callable[[list[SequenceState]], None]
    finished: Callable[[SequenceState, Completion], None]
    cancelled: Callable[[], list[int]] = list
    stopped: Callable[[], list[int]] = list


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
        self.link = Link(comm, self.config.hidden_size, stage.dtype, stage.device)
        self.last_generate: dict[str, float] = {}
        self.last_output: Output | None = None  # on first-stage ranks: what the latest generate produced
        self._prompt_cols = 0
        self._decode_mark: tuple[float, Counters] | None = None  # when the decode steps began
        # the per-step token budget of a continuous batch (decodes + joiners' prompt chunks:
        # chunking.py); the leader's, sent with each generate so that every rank composes alike
        self.step_tokens = step_tokens or step_token_budget(stage.device.type)
        # decode steps replayed from captured graphs (graphs.py), or None: the eager step
        mode = chosen_mode(stage, comm)
        self.graphs = DecodeGraphs(stage, cache, rotary, comm, mode) if mode != "off" else None
        # The paged KV cache's bookkeeping (kvblocks.py): the leader's alone decides which blocks
        # each sequence holds; the other ranks hear it with the requests and joins.
        self.blocks = Blocks(cache.num_blocks, cache.block_size, decides=comm.topo.rank == 0,
                             first_id=RESERVED_BLOCKS)
        self.preemptions = 0  # the leader's: running sequences preempted for lack of KV blocks, ever

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
        self._prompt_cols, self._decode_mark = prompt_cols, None
        rows = Rows(self.cache.batch, sampler=self.topo.is_last, grammars=self.grammars,
                    blocks_per_row=self.cache.blocks_per_row)
        for row, (r, (blocks, first)) in enumerate(zip(requests, places, strict=True)):
            rows.place(row, r, prompt_cols - len(r.prompt_ids), blocks, first)
            self.blocks.hold(row, blocks)
        try:
            with torch.inference_mode():
                if self.topo.is_first:
                    out = self._drive(requests, rows, return_logits, hooks, continuous)
                else:
                    self._relay(rows, return_logits)
                    out = None
                self.link.flush()
        finally:
            self.blocks.release_all()  # the leader's: every sequence of this generate has ended
        after, end = self.acct.snapshot(), time.perf_counter()
        self.last_generate = {"seconds": end - start, **after.minus(before).summary()}
        if self._decode_mark is not None:  # the same figures for the decode steps alone
            mark_time, mark = self._decode_mark
            decode = after.minus(mark).summary()
            self.last_generate.update({"decode_seconds": end - mark_time,
                                       **{f"decode_{k}": v for k, v in decode.items()}})
        if out is not None:  # the first stage counts the steps: with them, the time of one step
            self.last_generate["decode_steps"] = out.decode_steps
        self.last_output = out
        return out

    def _forward(self, unit: Unit, x: torch.Tensor, rows: Rows) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The unit through this stage: its hidden states [rows, cols, H] (None for a replayed
        decode step on the last stage), and on the last stage after an emitting unit the float32
        logits [rows, vocab] of its last column (else None)."""
        if self._decode_mark is None and unit.c0 >= self._prompt_cols and not unit.positions:  # the first decode step
            self._decode_mark = (time.perf_counter(), self.acct.snapshot())
        logits_here = self.topo.is_last and unit.emits
        with self.acct.computing():
            if self.graphs is not None and unit.cols == 1 and not unit.positions:  # a decode step, replayed
                out = self.graphs.run(unit.r0, unit.r1, unit.c0, x, rows.pads, rows.tables)
                return (None, out) if self.topo.is_last else (out, None)
            step = Step.build(unit.r0, unit.r1, unit.c0, unit.c1, self._pads(unit, rows), self.rotary,
                              self.stage.windows, self.stage.dtype, self.stage.device, tables=rows.tables,
                              starts=rows.starts)
            hidden = self.stage.forward(x, step, self.cache)
            return hidden, self.stage.logits(hidden[:, -1]) if logits_here else None

    @staticmethod
    def _pads(unit: Unit, rows: Rows) -> torch.Tensor:
        """The rows' paddings in `unit`: a parked row's chunk is computed by position (padding 0)."""
        return torch.zeros_like(rows.pads) if unit.positions else rows.pads

    def _sample(self, unit: Unit, logits: torch.Tensor, rows: Rows,
                return_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The unit's tokens (on the host: the sampler's one device-to-host copy of the step)."""
        with self.acct.computing():
            tokens, failed, _ = rows.choose(unit.r0, logits)
        for row, why in failed.items():  # that request fails alone (every sampler meets the same)
            log(self.topo.rank, f"the sequence in row {row} failed: {why}")
        return tokens, (logits if return_logits else None)

    def _prompt_logprobs(self, unit: Unit, hidden: torch.Tensor, rows: Rows) -> None:
        """The last stage: the prompt log-probabilities (echo) the unit's rows asked for."""
        requests = rows.requests[unit.r0:unit.r1]
        if any(q is not None and q.prompt_logprobs for q in requests):
            with self.acct.computing():
                rows.extras.prompt(requests, self._pads(unit, rows), unit.r0, unit.c0, hidden, self.stage.logits)

    def _pass(self, work: list[tuple[Unit, torch.Tensor]], rows: Rows,
              vocab: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run each unit, with its token ids, through the pipeline. Returns the tokens (and with
        `vocab`, the logits) sampled after the emitting units, in row order."""
        last = self.topo.is_last
        emitted: list[tuple[Unit, torch.Tensor, torch.Tensor | None]] = []
        for unit, ids in work:
            hidden, logits = self._forward(unit, ids.to(self.stage.device, non_blocking=True), rows)
            if not last:
                assert hidden is not None  # only the last stage's replayed step keeps its hidden states
                self.link.send_unit(unit, hidden)
            else:
                if hidden is not None:
                    self._prompt_logprobs(unit, hidden, rows)
                if unit.emits:
                    assert logits is not None  # the last stage has logits after an emitting unit
                    emitted.append((unit, *self._sample(unit, logits, rows, vocab is not None)))
        if not last:
            emitted = []
            for u, _ in work:
                if u.emits:
                    emitted.append((u, *self.link.recv_tokens(u.rows, vocab)))
                    if logprobs.wants(rows.requests[u.r0:u.r1]):
                        rows.extras.merge(self.link.recv_extras())
        emitted.sort(key=lambda e: e[0].r0)
        if not emitted:  # chunks of prompts that do not end yet
            return torch.zeros(0, dtype=torch.int64), None
        tokens = torch.cat([t for _, t, _ in emitted])
        return tokens, (torch.cat([lg for _, _, lg in emitted if lg is not None]) if vocab is not None else None)

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

        col, prefills = self._prompt_cols, list[Prefill]()
        while seqs.live():
            col, joined, join_tokens = self._join(seqs, rows, col, prefills, hooks, continuous)
            if not seqs.live():  # every client left, and nobody joined
                break
            # Rows outside the decoding ones are not computed (a CPU matmul of 4 rows can cost
            # twice one row's); logits are returned for every row of a fixed batch.
            span = (0, rows.used) if return_logits else seqs.live_span()
            if span is None:  # every running sequence's prompt is still being computed
                continue
            lo, hi = span
            unit = Unit(lo, hi, col, col + 1, emits=True)
            tokens, logits = self._pass([(unit, seqs.next_tokens[lo:hi].view(hi - lo, 1))], rows, vocab)
            out.logits += [logits.cpu()] if logits is not None else []
            seqs.feed(slice(lo, hi), tokens)  # the next step's input ids, on the device
            took = seqs.add(joined, join_tokens, rows.failures, rows.extras) + \
                seqs.add(list(range(lo, hi)), tokens.tolist(), rows.failures, rows.extras)
            self._report(list(dict.fromkeys(took)), hooks)  # a joiner took two tokens: report it once
            col += 1
            out.decode_steps += 1
            out.decode_rows += hi - lo
        if not self.topo.is_last:
            self.link.send_stop()
        out.decode_seconds = time.perf_counter() - start - out.prefill_seconds
        out.completions = [s.completion() for s in seqs.all]
        return out

    def _prefill(self, requests: list[GenerateRequest], rows: Rows,
                 vocab: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first batch's prompts, left-padded to the longest, in micro-batches and chunks."""
        prompt_cols = self._prompt_cols
        ids = torch.zeros(len(requests), prompt_cols, dtype=torch.int64)
        for i, r in enumerate(requests):
            ids[i, int(rows.pads[i]):] = torch.tensor(r.prompt_ids)
        # what every row took from the prefix cache is not computed again (when all of them took some)
        c0 = int((rows.pads + rows.starts)[:len(requests)].min())
        units = prefill_units((0, len(requests)), (c0, prompt_cols), self.topo.pp)
        return self._pass([(u, ids[u.r0:u.r1, u.c0:u.c1]) for u in units], rows, vocab)

    def _report(self, took: list[SequenceState], hooks: Hooks | None) -> None:
        """Tell the batcher (on the leader) which sequences took a token, and which stopped."""
        if hooks is None:
            return
        hooks.step(took)
        for seq in took:
            if seq.finished:
                hooks.finished(seq, seq.completion())

    def _join(self, seqs: Sequences, rows: Rows, col: int, prefills: list[Prefill], hooks: Hooks | None,
              continuous: bool) -> tuple[int, list[int], list[int]]:
        """The joiners' side of a step at decode column `col` (`chunking.py`): those who join now
        take free rows (the rows of sequences that stopped, were cancelled or preempted), parked (a
        preempted sequence rejoins with its prompt and the tokens it generated as its prompt); then a chunk
        of each joiner's prompt, oldest first, under the step's token budget. The joiners whose
        prompts end now are framed in (the batch's paddings move so that their prompts end at the
        decode column) and their first tokens become their inputs to the decode step. Returns the
        decode column, their rows and first tokens."""
        self._free_finished(seqs, rows)
        newcomers, col = self._orders(seqs, rows, col, hooks) if continuous else ([], col)
        # those cancelled or preempted mid-prompt let their rows go (before anyone takes them)
        prefills[:] = [p for p in prefills if (seq := seqs.by_row[p.row]) is not None and seq.prefilling
                       and not seq.finished]
        for row, (request, (blocks, first)) in zip(seqs.free_rows()[:len(newcomers)], newcomers, strict=False):
            generated = 0
            if request is None:  # the first preempted sequence rejoins: its prompt and what it generated
                seq = seqs.resume(row)
                request, generated = seq.recompute(), len(seq.tokens)
            else:
                seq = seqs.start(row, request)
                seq.cached_tokens = first  # the prefix cache's positions are not computed again
            seq.prefilling = True
            self._take_row(rows, Join(row, PARKED, request, tuple(blocks), first, generated))
            prefills.append(Prefill(row, len(request.prompt_ids), first, request.max_new_tokens))
        if not prefills:
            return col, [], []
        decoding = {}
        for row in seqs.decoding():
            seq = seqs.by_row[row]
            assert seq is not None
            decoding[row] = (col - int(rows.pads[row]), seq.request.max_new_tokens - len(seq.tokens))
        chunks, col, pads = plan_step(prefills, decoding, col, self.step_tokens, self.max_len)
        joined = sorted(c.row for c in chunks if c.last)
        if joined:  # reframed: every stage takes the new paddings before the chunks
            new = rows.pads.clone()
            new[list(pads)] = torch.tensor(list(pads.values()), dtype=torch.int64)
            rows.set_pads(new)
            if not self.topo.is_last:
                self.link.send_pads(new)
        # the rows' requests: a recomputed sequence's prompt ends with the tokens it generated
        prompts = {c.row: torch.tensor([rows.requests[c.row].prompt_ids]) for c in chunks}  # type: ignore[union-attr]
        work = [(u, prompts[c.row][:, u.c0:u.c1]) for c in chunks
                for u in chunk_units(c.row, c.start, c.end, c.last, self.topo.pp)]
        tokens, _ = self._pass(work, rows, None)
        prefills[:] = [p for p in prefills if p.remaining > 0]
        for row in joined:
            seqs.by_row[row].prefilling = False  # type: ignore[union-attr]
        self.blocks.computed(joined)
        seqs.feed(joined, tokens)
        return col, joined, tokens.tolist()

    def _take_row(self, rows: Rows, join: Join) -> None:
        """A joiner takes its row on this rank (and is passed on down the pipeline): its padding,
        its block table and first own position. Its prefill writes its own positions; what the
        row's previous sequence left is in blocks it no longer holds (paging.py)."""
        rows.place(join.row, join.request, join.pad, join.blocks, join.start, join.generated)
        self.blocks.hold(join.row, list(join.blocks))
        if not self.topo.is_last:
            self.link.send_join(join)

    def _free_finished(self, seqs: Sequences, rows: Rows) -> None:
        """Every first-stage rank, at a step boundary: the rows whose sequences have stopped let go
        of their blocks (the leader's pool takes them back; their full prompt blocks stay in the
        prefix cache), here and down the pipeline, before anyone joins."""
        for row, seq in enumerate(seqs.by_row):
            if seq is not None and seq.finished and bool((rows.tables[row] != TRASH_BLOCK).any()):
                rows.free(row)
                self.blocks.release(row)
                if not self.topo.is_last:
                    self.link.send_free(row)

    def _orders(self, seqs: Sequences, rows: Rows, col: int,
                hooks: Hooks | None) -> tuple[list[tuple[GenerateRequest | None, tuple[list[int], int]]], int]:
        """A step boundary's orders: the sequences whose clients left or whose text met a stop
        string stop (and let go of their blocks); every running sequence gets the KV block its
        next position needs, the newest being preempted when none is free (`preemption.py`); then the
        preempted sequences rejoin, first come first served, and while none is left waiting,
        newcomers are admitted into the free rows, each with the KV blocks the leader reserved
        for it. The leader decides, asking its batcher; its first-stage TP peers hear all of it
        from the leader (one small message a step: they must all run the same units). Returns
        the joiners (None for the next preempted sequence) with their places (blocks, first own
        position), and the decode column (which moves when nothing runs and the first preempted
        sequence does not fit the columns left)."""
        orders: dict[str, Any] | None = None
        chosen: list[tuple[GenerateRequest | None, tuple[list[int], int]]] = []
        if hooks is not None:
            cancelled, stopped = hooks.cancelled(), hooks.stopped()
            seqs.cancel(cancelled)
            for seq in seqs.stop(stopped):
                hooks.finished(seq, seq.completion())
            self._free_finished(seqs, rows)
            actions = grow(self.blocks, seqs, rows.pads, col, lambda action: self._apply(seqs, rows, action))
            self.preemptions += sum(1 for action in actions if action[0] == "preempt")
            head, moved = seqs.waiting(), col
            if head is not None and not seqs.running() and not fits_at(head.recompute(), col, self.max_len):
                col = len(head.recompute().prompt_ids)  # nothing runs: start the columns again
            chosen = rejoin(self.blocks, seqs, col, self.max_len)
            free = len(seqs.free_rows()) - len(chosen)
            # newcomers wait while a preempted sequence does (they would take its blocks)
            admitted = hooks.admit(free if len(chosen) == len(rejoining(seqs)) else 0, col)
            room = self.blocks.room(seqs.running() or bool(chosen))
            if len(admitted) > free or not all(fits_at(r, col, self.max_len) for r in admitted) \
                    or sum(self.blocks.admission(r) for r in admitted) > room:
                raise ValueError(f"the batcher admitted {len(admitted)} requests into {free} free rows at column "
                                 f"{col} and {room} free KV blocks, not all of which fit")
            chosen += [(r, self.blocks.reserve(r, optimistic=True)) for r in admitted]
            if cancelled or stopped or actions or chosen or col != moved:
                orders = {"cancel": cancelled, "stop": stopped, "actions": actions, "col": col,
                          "join": [[None if r is None else r.model_dump(), place] for r, place in chosen]}
        if self.topo.tp > 1:
            sent = self.comm.broadcast_in_stage(orders)
            if hooks is None and sent is not None:
                seqs.cancel(sent["cancel"])
                seqs.stop(sent["stop"])
                self._free_finished(seqs, rows)
                for action in sent["actions"]:
                    self._apply(seqs, rows, action)
                col = sent["col"]
                chosen = [(None if r is None else GenerateRequest.model_validate(r), (list(b), int(st)))
                          for r, (b, st) in sent["join"]]
        return chosen, col

    def _apply(self, seqs: Sequences, rows: Rows, action: list) -> None:
        """One of the leader's block orders (`preemption.grow`) on this rank, and down the pipeline."""
        if action[0] == "grow":
            more = Grow(*action[1:])
            rows.grow(more.row, more.index, more.block)
            if not self.topo.is_last:
                self.link.send_grow(more)
        else:
            row = action[1]
            seqs.preempt(row)
            rows.free(row)
            if not self.topo.is_last:
                self.link.send_free(row)

    def _relay(self, rows: Rows, return_logits: bool) -> None:
        """A later stage: run each unit as it arrives, take each join's row; the last stage sends
        tokens back."""
        last = self.topo.is_last
        while (got := self.link.recv()) is not None:
            if isinstance(got, Join):
                self._take_row(rows, got)
                continue
            if isinstance(got, Free):
                rows.free(got.row)
                if not last:
                    self.link.send_free(got.row)
                continue
            if isinstance(got, Pads):
                rows.set_pads(got.values)
                if not last:
                    self.link.send_pads(got.values)
                continue
            if isinstance(got, Grow):
                rows.grow(got.row, got.index, got.block)
                if not last:
                    self.link.send_grow(got)
                continue
            unit, received = got
            hidden, logits = self._forward(unit, received, rows)
            if not last:
                assert hidden is not None  # only the last stage's replayed step keeps its hidden states
                self.link.send_unit(unit, hidden)
                continue
            if hidden is not None:
                self._prompt_logprobs(unit, hidden, rows)
            if unit.emits:
                assert logits is not None  # the last stage has logits after an emitting unit
                self.link.send_tokens(*self._sample(unit, logits, rows, return_logits))
                if logprobs.wants(rows.requests[unit.r0:unit.r1]):
                    self.link.send_extras(rows.extras.unit(unit.r0, unit.r1))
        if not last:
            self.link.send_stop()
