"""The leader's queue of waiting requests, and the thread that runs them through the engine.

Continuous batching. When the engine is free it takes every waiting request that fits one batch
(the plan's maxBatchSize, and maxModelLen once prompts are padded to the longest) and starts a
`generate` with them. While that runs, the engine asks at every decode step boundary who joins
(`Hooks.admit`): waiting requests, in queue order, take the rows of sequences that have finished
(or rows the batch never used), as long as their prompt ends at the current decode column
(prompt <= column) and their new tokens still fit the cache (column + max_new_tokens - 1 <=
maxModelLen); one that does not fit yet is passed over for those behind it. Each is prefilled in
its row and decodes with the others from the next step. A sequence's answer is delivered when it
stops, not when the batch ends. The batch ends when every sequence has stopped; the next one
starts at column 0 again, so a request that could not join (its prompt is longer than the
current column, or the batch has too few columns left) waits at most for the running batch to
drain (at most maxModelLen steps: the column moves one a step, and no one joins past it).
A request whose client hangs up (`cancel`) leaves the queue, or stops at the next step boundary
and frees its row (`Hooks.cancelled`); so does one whose text met a stop string (`stop`: the
leader's text side finds them, `text.py`).

A request is admitted when the KV blocks of its prompt are free (less the engine's watermark),
not those of every token it may generate: its sequence takes blocks as it grows, and when none is
free the engine preempts the newest running sequence, which rejoins later from its prompt and the
tokens it generated (`Boundary.orders`): its request stays in `running` (its stream just pauses), and
newcomers wait while it does. The preemptions are counted in /metrics.

Only the engine thread touches torch.distributed. The HTTP side talks to it through `Sink`s
(`events.py`): each request's events (`Step`, then one `Done` or `Failed`) are handed to its
asyncio loop, or to the pipe to the leader's HTTP process, never awaited by the engine.

Every request that was queued is logged once when it ends (`servelog.request_line`), and while
the engine works a throughput line every 10 s; the gauges of running and waiting requests and of
the KV cache's use are set at every step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from shard_contract.wire import Completion, GenerateRequest

from ..engine.boundary import Hooks
from ..engine.engine import Engine, RequestError
from ..engine.preemption import fits_at
from ..engine.sequences import SequenceState
from ..log import first_line, log
from ..telemetry.rankmetrics import RankMetrics
from .events import Pending, Unavailable
from .servelog import Throughput, request_line

MAX_WAITING = 256
# When the engine is free and a request arrives, wait this long for others to arrive with it:
# clients that send in step (or one client's parallel requests) then start one batch together,
# padded to the longest prompt, instead of the rest joining the first one row by row (a joiner's
# prompt must fit before the current column, which a batch started alone is short of).
GATHER_SECONDS = 0.02
LEADER = 0  # the rank the engine loop runs on, in its log lines


def take_batch(waiting: Sequence[GenerateRequest], max_batch: int, max_len: int,
               blocks: Callable[[GenerateRequest], int] = lambda r: 0, free_blocks: int = 0) -> int:
    """How many requests from the front of the queue form the next batch (at least one).

    First come, first served: the batch grows until the next request would not fit, because the
    batch is padded to its longest prompt and every sequence needs padded prompt + new tokens - 1
    cache columns, and the KV blocks it is admitted with (`blocks`: its prompt's and its first
    decode position's, `Blocks.admission`; it takes more as it grows) must be among the
    `free_blocks` (the head always fits an idle cache: `Engine.check`).
    """
    longest, most_new, taken = 0, 0, 0
    for n, request in enumerate(waiting[:max_batch]):
        longest = max(longest, len(request.prompt_ids))
        most_new = max(most_new, request.max_new_tokens)
        taken += blocks(request)
        if n > 0 and (longest + most_new - 1 > max_len or taken > free_blocks):
            return n
    return max(1, min(len(waiting), max_batch))


def take_joiners(waiting: Sequence[GenerateRequest], free_rows: int, col: int, max_len: int,
                 blocks: Callable[[GenerateRequest], int] = lambda r: 0, free_blocks: int = 0) -> list[int]:
    """The positions in the queue of the requests that join a running batch at decode column
    `col`: in queue order, every one that fits the columns left, while rows are free and the KV
    blocks they are admitted with are among the `free_blocks`; the first whose blocks are not stops
    the others (it waits for blocks to free up, and no one overtakes it)."""
    chosen: list[int] = []
    for i, request in enumerate(waiting):
        if len(chosen) == free_rows:
            break
        if fits_at(request, col, max_len):
            free_blocks -= blocks(request)
            if free_blocks < 0:
                break
            chosen.append(i)
    return chosen


class EngineLoop:
    """Runs on the leader's engine thread: `run()` until `close()`, or until the group is lost."""

    def __init__(self, engine: Engine, max_batch: int, max_len: int, metrics: RankMetrics,
                 idle_seconds: float, max_waiting: int = MAX_WAITING, gather_seconds: float = GATHER_SECONDS):
        self.engine, self.max_batch, self.max_len, self.metrics = engine, max_batch, max_len, metrics
        self.idle_seconds, self.max_waiting, self.gather_seconds = idle_seconds, max_waiting, gather_seconds
        self.cond = threading.Condition()
        self.waiting: deque[Pending] = deque()
        self.running: list[Pending] = []
        self.cancelling: list[int] = []  # indices into `running` whose clients have gone
        self.stopping: list[int] = []  # indices into `running` whose text met a stop string
        self.lost = ""  # why the group is lost; set once, never cleared
        self.closing = False
        self.started = threading.Event()
        self.throughput = Throughput()
        self.kv_tokens = 0  # KV-cache positions the running requests took at the latest step
        self._prefix_seen = (0, 0, 0)  # the preemptions, prefix-cache block lookups and hits counted so far

    # ------------------------------------------------------------ any thread
    def submit(self, pending: Pending) -> None:
        """Queue `pending`, or refuse it: Unavailable, or a 400 on its sink when the group can
        never run it."""
        try:
            self.engine.check(pending.request)
        except RequestError as err:
            if pending.sink.fail(str(err), 400):
                self.metrics.outcome("rejected")
            return
        with self.cond:
            if self.lost:
                raise Unavailable(self.lost)
            if self.closing:
                raise Unavailable("the server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise Unavailable(f"{len(self.waiting)} requests are already waiting; try again later", 429)
            self.waiting.append(pending)
            self.metrics.waiting(len(self.waiting))
            self.cond.notify()

    def cancel(self, pending: Pending) -> None:
        """Its client has gone: a waiting request leaves the queue; a running one stops at the
        engine's next step boundary and frees its row. Nothing more is delivered to it."""
        if not pending.sink.abandon():  # answered, failed or cancelled already
            return
        with self.cond:
            if pending in self.waiting:
                self.waiting.remove(pending)
                self.metrics.waiting(len(self.waiting))
            elif pending in self.running:
                self.cancelling.append(self.running.index(pending))
        self.metrics.outcome("cancelled")
        self._ended(pending, "cancelled")

    def stop(self, pending: Pending) -> None:
        """The text side found a stop string in its tokens: its sequence stops at the engine's next
        step boundary, and is answered then (finish reason "stop") as any that ends."""
        with self.cond:
            if pending in self.running and not pending.sink.closed:
                self.stopping.append(self.running.index(pending))

    def fail_all(self, reason: str) -> None:
        """The group is lost: every running and waiting request ends with `reason`, now."""
        with self.cond:
            self.lost = self.lost or reason
            victims = self.running + list(self.waiting)
            self.waiting.clear()
            self.metrics.waiting(0)
            self.cond.notify_all()
        for pending in victims:
            if pending.sink.fail(f"the group failed: {self.lost}"):
                self.metrics.outcome("failed")
                self._ended(pending, "failed")

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()

    # ------------------------------------------------------------ the engine thread
    def run(self) -> None:
        self.started.set()
        try:
            while (batch := self._next()) is not None:
                if batch:
                    self._run(batch)
                else:
                    self.engine.heartbeat()  # keep the followers' collective timeout from expiring
                    self._publish(0, 0)  # the last throughput line of a burst
        except Exception as err:  # a collective failed: a rank died, or the group timed out
            self.fail_all(first_line(err))
            raise
        finally:
            self._finish()

    def _next(self) -> list[Pending] | None:
        """The next batch; [] after an idle wait; None when closing or lost."""
        with self.cond:
            if not self.waiting and not self.closing and not self.lost:
                if self.cond.wait(self.idle_seconds) and self.waiting:  # woken by a first arrival
                    deadline = time.monotonic() + self.gather_seconds
                    while len(self.waiting) < self.max_batch and not (self.closing or self.lost) \
                            and (left := deadline - time.monotonic()) > 0:
                        self.cond.wait(left)
            if self.lost or self.closing:
                return None
            if not self.waiting:
                return []
            n = take_batch([p.request for p in self.waiting], self.max_batch, self.max_len,
                           self.engine.blocks.admission, self.engine.blocks.room(running=False))
            self.running = [self.waiting.popleft() for _ in range(n)]
            self.metrics.waiting(len(self.waiting))
        self._started(self.running)
        self.throughput.busy(time.monotonic())
        self._publish(len(self.running), sum(len(p.request.prompt_ids) for p in self.running))
        return list(self.running)

    def _run(self, batch: list[Pending]) -> None:
        """One continuous `generate`, started with `batch`; `self.running` grows as others join,
        in the engine's order of arrival (a sequence's `index`)."""
        hooks = Hooks(admit=self._admit, step=self._step, finished=self._finished, cancelled=self._cancelled,
                      stopped=self._stopped)
        try:
            self.engine.generate([p.request for p in batch], hooks=hooks)
        except RequestError as err:  # refused before any rank did work: the group is fine
            self._ran()
            for pending in batch:
                if pending.sink.fail(str(err), 400):
                    self.metrics.outcome("rejected")
                    self._ended(pending, "rejected")
            return
        # (any other error leaves the batch in `running`, for `fail_all`)
        self._ran()

    def _admit(self, free_rows: int, col: int) -> list[GenerateRequest]:
        with self.cond:
            if not self.waiting or self.closing or self.lost:
                return []
            chosen = take_joiners([p.request for p in self.waiting], free_rows, col, self.max_len,
                                  self.engine.blocks.admission, self.engine.blocks.room())
            joining = [self.waiting[i] for i in chosen]
            for i in reversed(chosen):
                del self.waiting[i]
            self.running.extend(joining)
            self.metrics.waiting(len(self.waiting))
        self._started(joining)
        return [p.request for p in joining]

    def _started(self, pendings: list[Pending]) -> None:
        now = time.monotonic()
        for pending in pendings:
            self.metrics.started(now - pending.sink.arrived, len(pending.request.prompt_ids))

    def _cancelled(self) -> list[int]:
        with self.cond:
            cancelled, self.cancelling = self.cancelling, []
        return cancelled

    def _stopped(self) -> list[int]:
        with self.cond:
            stopped, self.stopping = self.stopping, []
        return stopped

    def _step(self, seqs: list[SequenceState]) -> None:
        self.metrics.batch(len(seqs))
        prompt = generated = 0
        for seq in seqs:
            sink = self.running[seq.index].sink
            prompt += len(seq.request.prompt_ids) if sink.generated == 0 else 0  # prefilled in this step
            previous = sink.last_token_at
            asked = seq.request.logprobs is not None
            generated += sink.step(seq.tokens, seq.logprobs if asked else None, seq.top_logprobs if asked else None)
            if previous is not None and sink.last_token_at is not None:
                self.metrics.token_gap(sink.last_token_at - previous)
        self.throughput.step(time.monotonic(), prompt, generated)
        self.metrics.tokens(generated)
        self._publish(len(seqs), sum(len(seq.request.prompt_ids) + len(seq.tokens) for seq in seqs))

    def _finished(self, seq: SequenceState, completion: Completion) -> None:
        pending = self.running[seq.index]
        sink = pending.sink
        if completion.finish_reason == "error":
            if not sink.fail(f"this request failed: {completion.error}", 500):
                return
            self.metrics.outcome("failed")
        elif sink.done(completion):
            now = time.monotonic()
            first = sink.first_token_at or now
            self.metrics.finished(now - sink.arrived, first - sink.arrived, len(completion.token_ids))
        else:  # its client had gone: logged as cancelled
            return
        self._ended(pending, completion.finish_reason)

    def _ran(self) -> None:
        with self.cond:
            self.running, self.cancelling, self.stopping = [], [], []
        self._publish(0, 0)

    def _publish(self, running: int, kv_tokens: int) -> None:
        """The gauges of the `running` requests (those that took a token in the last step) and of
        the KV-cache positions they take, and the throughput line when one is due."""
        self.metrics.running(running, kv_tokens)
        self.kv_tokens = kv_tokens
        pool = self.engine.blocks.pool  # the paged KV cache: blocks held, and the prefix cache's lookups
        self.metrics.kv_blocks(pool.used_blocks, pool.free_blocks)
        seen = (self.engine.preemptions, pool.queries, pool.hits)
        self.metrics.scheduled(*(now - before for now, before in zip(seen, self._prefix_seen, strict=True)))
        self._prefix_seen = seen
        line = self.throughput.line(time.monotonic(), running, len(self.waiting), self.max_batch, kv_tokens,
                                    self.max_batch * self.max_len)
        if line is not None:
            log(LEADER, line)

    def _ended(self, pending: Pending, finish: str) -> None:
        """Its one log line, when a request that was queued ends."""
        sink = pending.sink
        log(LEADER, request_line(pending.id, len(pending.request.prompt_ids), sink.generated, sink.arrived,
                                 sink.first_token_at, time.monotonic(), finish))

    def _finish(self) -> None:
        with self.cond:
            leftovers = list(self.waiting)
            self.waiting.clear()
        for pending in leftovers:
            if pending.sink.fail("the server is shutting down"):
                self.metrics.outcome("failed")
                self._ended(pending, "failed")
        if not self.lost:
            try:
                self.engine.shutdown()  # the followers leave `follow()` and exit
            except Exception:  # noqa: BLE001 -- they are already gone (stopped with us): nothing to tell
                pass


class LocalLink:
    """`events.Link` to an engine loop in this process (the HTTP side and the engine in one)."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop

    async def submit(self, pendings: list[Pending]) -> None:
        try:
            for pending in pendings:
                self.loop.submit(pending)
        except Unavailable:
            for pending in pendings:
                self.loop.cancel(pending)
            raise

    def cancel(self, pending: Pending) -> None:
        self.loop.cancel(pending)

    def stop(self, pending: Pending) -> None:
        self.loop.stop(pending)
