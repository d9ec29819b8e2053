"""The first stage's step boundary: who stops, grows, is preempted and joins before a decode step,
and which chunks of the joiners' prompts are computed in it.

A continuous batch (the server) lets requests join at each decode step boundary, into the rows of
finished (or cancelled: their clients hung up) sequences, their prompts computed a chunk a step
beside the running decodes within a per-step token budget (`chunking.py`): the leader's batcher
chooses them (`Hooks`), and the leader tells its first-stage TP peers who joins and who is
cancelled at every step, with one small message (an empty one costs a shared-memory round where
the peers share a machine, else one gloo broadcast); the later stages learn of each change from
the headers the runner sends down the pipeline (`runner.py`). A continuous batch's sequences take
KV blocks as they grow, and when none is free the newest is preempted, to rejoin later from its
prompt and the tokens it generated (`preemption.py`): those orders ride in the same message. A
fixed batch only lets the rows of its stopped sequences go.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shard_contract.wire import Completion, GenerateRequest

from ..comm.dist import Comm
from ..model.paging import TRASH_BLOCK
from .chunking import Prefill, plan_step
from .kvblocks import Blocks
from .pipeline import Grow, Join, chunk_units
from .preemption import fits_at, grow, rejoin, rejoining
from .runner import Runner
from .sequences import PARKED, Rows, Sequences, SequenceState


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


class Boundary:
    def __init__(self, runner: Runner, comm: Comm, blocks: Blocks, max_len: int):
        self.runner, self.comm, self.blocks, self.max_len = runner, comm, blocks, max_len
        self.topo = comm.topo
        self.preemptions = 0  # the leader's: running sequences preempted for lack of KV blocks, ever

    def join(self, seqs: Sequences, rows: Rows, col: int, prefills: list[Prefill], hooks: Hooks | None,
             continuous: bool, step_tokens: int) -> tuple[int, list[int], list[int]]:
        """The joiners' side of a step at decode column `col` (`chunking.py`): those who join now
        take free rows (the rows of sequences that stopped, were cancelled or preempted), parked (a
        preempted sequence rejoins with its prompt and the tokens it generated as its prompt); then a chunk
        of each joiner's prompt, oldest first, under the step's token budget. The joiners whose
        prompts end now are framed in (the batch's paddings move so that their prompts end at the
        decode column) and their first tokens become their inputs to the decode step. Returns the
        decode column, their rows and first tokens."""
        self.free_finished(seqs, rows)
        newcomers, col = self.orders(seqs, rows, col, hooks) if continuous else ([], col)
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
            self.runner.take_row(rows, Join(row, PARKED, request, tuple(blocks), first, generated))
            prefills.append(Prefill(row, len(request.prompt_ids), first, request.max_new_tokens))
        if not prefills:
            return col, [], []
        decoding = {}
        for row in seqs.decoding():
            seq = seqs.by_row[row]
            assert seq is not None
            decoding[row] = (col - int(rows.pads[row]), seq.request.max_new_tokens - len(seq.tokens))
        chunks, col, pads = plan_step(prefills, decoding, col, step_tokens, self.max_len)
        joined = sorted(c.row for c in chunks if c.last)
        if joined:  # reframed: every stage takes the new paddings before the chunks
            new = rows.pads.clone()
            new[list(pads)] = torch.tensor(list(pads.values()), dtype=torch.int64)
            self.runner.set_pads(rows, new)
        # the rows' requests: a recomputed sequence's prompt ends with the tokens it generated
        prompts = {c.row: torch.tensor([rows.requests[c.row].prompt_ids]) for c in chunks}  # type: ignore[union-attr]
        work = [(u, prompts[c.row][:, u.c0:u.c1]) for c in chunks
                for u in chunk_units(c.row, c.start, c.end, c.last, self.topo.pp)]
        # chunks that end no prompt ride with the step's decode unit where they can (`Runner.defer`)
        tokens = torch.zeros(0, dtype=torch.int64) if self.runner.defer(work) else self.runner.run(work, rows, None)[0]
        prefills[:] = [p for p in prefills if p.remaining > 0]
        for row in joined:
            seqs.by_row[row].prefilling = False  # type: ignore[union-attr]
        for c in chunks:  # the full blocks they completed join the prefix cache now, mid-prompt too
            self.blocks.written(c.row, c.end)
        seqs.feed(joined, tokens)
        return col, joined, tokens.tolist()

    def free_finished(self, seqs: Sequences, rows: Rows) -> None:
        """Every first-stage rank, at a step boundary: the rows whose sequences have stopped let go
        of their blocks (the leader's pool takes them back; their full prompt blocks stay in the
        prefix cache), here and down the pipeline, before anyone joins."""
        for row, seq in enumerate(seqs.by_row):
            if seq is not None and seq.finished and bool((rows.tables[row] != TRASH_BLOCK).any()):
                self.runner.free_row(rows, row)
                self.blocks.release(row)

    def orders(self, seqs: Sequences, rows: Rows, col: int,
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
            self.free_finished(seqs, rows)
            actions = grow(self.blocks, seqs, rows.pads, col, lambda action: self.apply(seqs, rows, action))
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
                self.free_finished(seqs, rows)
                for action in sent["actions"]:
                    self.apply(seqs, rows, action)
                col = sent["col"]
                chosen = [(None if r is None else GenerateRequest.model_validate(r), (list(b), int(st)))
                          for r, (b, st) in sent["join"]]
        return chosen, col

    def apply(self, seqs: Sequences, rows: Rows, action: list) -> None:
        """One of the leader's block orders (`preemption.grow`) on this rank, and down the pipeline."""
        if action[0] == "grow":
            self.runner.grow(rows, Grow(*action[1:]))
        else:
            row = action[1]
            seqs.preempt(row)
            self.runner.free_row(rows, row)
