"""One serving rank's life: its state, its threads, its signals and its exit.

A rank serves HTTP (the app `__main__` composes from `app.py` and `routes.py`) from the moment
it starts, while its engine thread joins the group and loads. Threads of one rank: uvicorn's
event loop on the main thread (it owns SIGTERM / SIGINT); the engine thread, which joins the
group, loads, and then runs batches (leader: the `batcher.EngineLoop`) or follows the leader's
commands (others); and the heartbeat thread (`health.py`). Only the engine thread touches
torch.distributed. The leader serves HTTP from a process of its own instead (`serve_apart`:
`serving/front.py`, reached through `bridge.py`); its main thread then only handles signals and
watches that process.

A rank stops on SIGTERM / SIGINT (the leader first finishes its batch and tells the followers),
when the leader says shutdown (a follower), or when it fails to load; it exits 0, or when it
failed 1, or 78 (EXIT_CONFIG) when a restart would fail the same way (a bad checkpoint, a plan this
process cannot run). SHARD_HOST (default 0.0.0.0) is the address to listen on; `shardctl run`
binds 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

import uvicorn

from shard_contract.env import EXIT_FAILED, HOST_ENV, WorkerEnv
from shard_contract.plan import Plan
from shard_contract.wire import LoadProgress, RankReport, ShardEntry, ShardsResponse

from ..log import first_line, log
from ..serving.batcher import EngineLoop, LocalLink
from ..serving.events import Unavailable
from ..serving.limits import ASGIApp, server_limits
from ..telemetry.accounting import MemorySample
from ..telemetry.health import Heartbeat, Record, Verdict, memory_problems, read_group_key
from ..telemetry.rankmetrics import RankMetrics
from .runtime import Worker, cache_rows, freeze_loaded_objects

GRACEFUL_SECONDS = 10  # in-flight requests get this long to finish on SIGTERM
JOIN_SECONDS = 15.0


class Rank:
    """One rank: its state and its group's verdict, its engine thread and heartbeat."""

    def __init__(self, env: WorkerEnv, plan: Plan, baseline: MemorySample, known_errors: tuple[type, ...] = (),
                 exit_status: Callable[[BaseException], int] = lambda err: EXIT_FAILED):
        """`known_errors`: logged as one line; `exit_status(err)`: the status a failed load exits with."""
        self.env, self.plan, self.baseline, self.known_errors = env, plan, baseline, known_errors
        self.exit_status = exit_status
        self.rank_plan = plan.rank_plan(env.replica, env.rank)
        self.rank, self.leader = env.rank, env.rank == 0
        self.metrics = RankMetrics(env.model_name, env.replica, self.rank_plan, self.leader,
                                   max_batch=cache_rows(plan), max_len=plan.max_model_len)
        self.worker: Worker | None = None
        self.state, self.error = "loading", ""
        self.problems: list[str] = []
        self.progress: tuple[int, int] | None = None  # set by the engine thread as it loads
        self.loop: EngineLoop | None = None
        self.heartbeat = Heartbeat(env.master_addr, env.master_port, env.rank, env.world_size, self._record,
                                   read_group_key(env.group_secret_file), on_lost=self._lost,
                                   on_rejected=self._rejected)
        self.exit_code = 0
        self.server: uvicorn.Server | None = None
        self.stopped = threading.Event()  # the rank is to stop (its main thread waits for it apart)
        self.engine_thread = threading.Thread(target=self._engine, name="engine", daemon=True)

    # ------------------------------------------------------------ state
    def _record(self, seq: int) -> Record:
        report = self.worker.report() if self.worker is not None else None
        return Record(rank=self.env.rank, seq=seq, state=self.state, problems=self.problems, error=self.error,
                      report=report, progress=self.progress)

    def _lost(self, reason: str) -> None:
        log(self.env.rank, f"the group is lost: {reason}")
        if self.loop is not None:
            self.loop.fail_all(reason)

    def _rejected(self, reason: str) -> None:
        log(self.env.rank, f"ignored a heartbeat record: {reason}")
        self.metrics.heartbeat_rejected()

    def verdict(self) -> Verdict:
        if self.state == "failed":
            return Verdict(False, False, f"rank {self.env.rank} failed: {self.error}", {})
        verdict = self.heartbeat.verdict()
        if self.state == "broken" and verdict.alive:  # before the heartbeats name the cause
            return Verdict(False, False, f"rank {self.env.rank} lost its group: {self.error}", verdict.ranks_alive)
        if verdict.alive and verdict.ready and self.leader and (self.loop is None or not self.loop.started.is_set()):
            return Verdict(True, False, "the leader's engine is starting", verdict.ranks_alive)
        return verdict

    def ready_loop(self) -> EngineLoop:
        """The leader's engine loop, when the group is ready to take requests; else Unavailable."""
        verdict = self.verdict()
        if not verdict.ready or self.loop is None:
            raise Unavailable(verdict.reason or "the group is not ready")
        return self.loop

    def kv_capacity(self) -> int:
        """Tokens of KV cache the group holds: its plan's, or once loaded what its paged pool holds
        for sequences (whole blocks)."""
        if self.worker is None:
            return self.plan.group_kv_cache_tokens(self.env.replica)
        return self.worker.cache.num_blocks * self.worker.cache.block_size

    def ready_link(self) -> LocalLink:
        """The routes' link to the leader's engine loop in this process (`ready_loop`'s)."""
        return LocalLink(self.ready_loop())

    def shards(self) -> ShardsResponse:
        """`GET /v1/shards`: every rank of the plan, with its latest published report once it has
        loaded."""
        verdict, records = self.verdict(), self.heartbeat.records()
        ranks = []
        for rp in self.plan.group(self.env.replica):
            record = records.get(rp.rank)
            alive = verdict.ranks_alive.get(rp.rank, verdict.alive)
            if record is None:
                ranks.append(ShardEntry(plan=rp, alive=alive))
                continue
            progress = LoadProgress(loaded=record.progress[0], total=record.progress[1]) if record.progress else None
            ranks.append(ShardEntry(plan=rp, report=RankReport.model_validate(record.report) if record.report else None,
                                    alive=alive, state=record.state, problems=record.problems, load_progress=progress))
        group = next(g for g in self.plan.groups if g.replica == self.env.replica)
        pool = self.loop.engine.blocks.pool if self.loop is not None else None  # the leader's paged KV cache
        return ShardsResponse(model=self.env.model_name, replica=self.env.replica, ready=verdict.ready,
                              reason=verdict.reason, predicted_step_seconds=group.critical_path_seconds,
                              kv_cache_tokens=self.kv_capacity(),
                              kv_cache_used_tokens=self.loop.kv_tokens if self.loop is not None else 0,
                              prefix_cache_queries=pool.queries if pool is not None else 0,
                              prefix_cache_hits=pool.hits if pool is not None else 0, ranks=ranks)

    def exposition(self, ready: bool) -> bytes:
        """`GET /metrics`: every family, up to date with this rank's measurements."""
        return self.metrics.exposition(self.worker, ready)

    def _stop_serving(self, code: int) -> None:
        self.exit_code = code
        self.stopped.set()
        if self.server is not None:
            self.server.should_exit = True

    # ------------------------------------------------------------ the engine thread
    def _engine(self) -> None:
        rank = self.env.rank
        start = time.perf_counter()
        try:
            worker = Worker.start(self.env, self.plan, self.baseline,
                                  progress=lambda loaded, total: setattr(self, "progress", (loaded, total)))
        except BaseException as err:  # noqa: BLE001 -- reported, and the process exits non-zero
            self.state, self.error = "failed", first_line(err)
            known = isinstance(err, self.known_errors)
            log(rank, f"{type(err).__name__}: {err}" if known else traceback.format_exc())
            self._stop_serving(self.exit_status(err))
            return
        log(rank, worker.loaded(time.perf_counter() - start))
        freeze_loaded_objects()
        self.problems = memory_problems(self.rank_plan, worker.resident, self.env.memory_budget_bytes)
        for problem in self.problems:
            log(rank, f"memory check failed: {problem}")
        self.worker = worker
        self.state = "ready"
        try:
            if self.leader:
                idle = max(1.0, min(30.0, self.env.rendezvous_timeout / 4))
                self.loop = EngineLoop(worker.engine, worker.cache.batch, self.plan.max_model_len,
                                       self.metrics, idle_seconds=idle)
                self.loop.run()
            else:
                worker.engine.follow()  # until the leader says shutdown
                self._stop_serving(0)
        except Exception as err:  # noqa: BLE001 -- a collective failed, or this rank's engine raised: the group is lost
            # the error as it is: a peer's death reads "RuntimeError: Connection closed by peer",
            # this rank's own fault its own exception (it was worded "a collective failed" either way)
            self.state, self.error = "broken", first_line(err)
            # the whole traceback, with the engine's note of the requests it held (`engine/diagnosis.py`):
            # a follower's own error is all the leader never sees
            log(rank, f"lost the group: {self.error}\n{traceback.format_exc().rstrip()}")
            if not self.leader:
                self._stop_serving(1)

    # ------------------------------------------------------------ run
    def serve(self, app: ASGIApp) -> NoReturn:
        host = os.environ.get(HOST_ENV, "0.0.0.0")
        config = uvicorn.Config(app, host=host, port=self.env.port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=GRACEFUL_SECONDS,
                                **server_limits(self.env.read_timeout))
        self.server = uvicorn.Server(config)
        # uvicorn re-raises the signal that stopped it once it has shut down; handlers of our own
        # let the process finish here instead (tell the followers, then exit).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        self.heartbeat.start()
        self.engine_thread.start()
        try:
            self.server.run()
        except SystemExit as err:  # uvicorn could not bind the port
            self.exit_code = int(err.code or 1)
        self._leave()

    def serve_apart(self) -> NoReturn:
        """The leader with its HTTP server in a process of its own (`serving/front.py`), which it
        talks to through `bridge.Bridge`: this process keeps the engine, its batcher and
        torch.distributed, and the heartbeat. When the HTTP process exits, the rank stops (exit 1,
        or the HTTP process's own status when it could not serve, such as 78 for an unreadable
        tokenizer); when this process dies, the kernel ends the HTTP process."""
        from ..serving import front
        from .bridge import Bridge

        ours, theirs = socket.socketpair()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopped.set())
        http = front.spawn(theirs)  # from the main thread, which lives until the process exits
        theirs.close()
        bridge = Bridge(ours, self)
        bridge.start()
        self.heartbeat.start()
        self.engine_thread.start()
        while not self.stopped.wait(0.2):
            if bridge.gone.is_set():  # the pipe ended: the HTTP process exited (or cannot serve)
                try:
                    http.wait(2)
                except subprocess.TimeoutExpired:
                    pass
            if http.poll() is not None:
                log(self.env.rank, f"the HTTP process exited with status {http.returncode}")
                self.exit_code = http.returncode if http.returncode and http.returncode > 0 else 1
                break
            if bridge.gone.is_set():
                self.exit_code = 1
                break
        if http.poll() is None:  # let it answer its in-flight requests, which the engine serves meanwhile
            http.terminate()
            try:
                http.wait(front.GRACEFUL_SECONDS + 5)
            except subprocess.TimeoutExpired:
                http.kill()
                http.wait()
        bridge.gone.wait(5)  # its open requests are cancelled
        self._leave(bridge.close)

    def _leave(self, *closing: Callable[[], None]) -> NoReturn:
        """Finish the leader's batch, tell the followers, and exit with `exit_code`."""
        if self.loop is not None:
            self.loop.close()  # the engine thread finishes its batch, then tells the followers
        # only a leader's batch is worth waiting for
        self.engine_thread.join(JOIN_SECONDS if self.loop is not None else 0.5)
        for close in closing:
            close()
        self.heartbeat.stop()
        # A thread still running is blocked in a collective with a lost group (or this is a
        # follower stopped while its leader lives): nothing to tear down cleanly.
        if self.worker is not None and not self.engine_thread.is_alive():
            self.worker.close()
        # Leave now: the interpreter's own teardown waits seconds on the store's and the
        # heartbeat's sockets, and everything this rank had to say is said.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.exit_code)



class RankProbes:
    """`app.Probes` of a rank whose app runs in the rank's own process."""

    def __init__(self, rank: Rank):
        self._rank, self.rank = rank, rank.rank

    @property
    def state(self) -> str:
        return self._rank.state

    def verdict(self) -> Verdict:
        return self._rank.verdict()

    async def shards(self) -> ShardsResponse:
        return self._rank.shards()

    async def exposition(self, ready: bool) -> bytes:
        return self._rank.exposition(ready)
