"""The leader's HTTP side apart from its engine: the pipe between them (`serving/ipc.py`), its two
ends (`rank/bridge.py` in the engine process, `serving/remote.py` in the HTTP process), run here in
one process over a real socket pair with a real engine loop (a scripted engine); and a served group
whose processes are killed or stopped: the probes tell the truth and the rank exits."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import struct
import threading

import pytest

from shard_contract.wire import Completion, ShardsResponse
from shard_operator.local.launcher import free_port, plan_local
from shard_operator.local.run import run_local
from shard_worker.rank.bridge import Bridge
from shard_worker.serving import ipc
from shard_worker.serving.batcher import EngineLoop
from shard_worker.serving.events import Done, Failed, Pending, Sink, Step, Unavailable
from shard_worker.serving.remote import EngineClient
from shard_worker.telemetry.health import Verdict
from tests.support.processes import alive, children, cmdline

from .conftest import get, shardctl_run, sharded_model_yaml, wait_for
from .test_health import ScriptedEngine, metrics, req, until


# ---------------------------------------------------------------- the pipe's messages
def test_steps_cross_as_deltas_and_come_back_whole():
    sent: dict[int, tuple[int, int]] = {}
    streams = ipc.Streams()

    def across(events):
        message = ipc.decode(ipc.encode({"op": "events", "items": ipc.event_items(events, sent)})[4:])
        return [streams.event(item) for item in message["items"]]

    assert across([(1, Step([5])), (2, Step([9], [-0.5], [[(9, -0.5), (3, -2.0)]]))]) == \
        [(1, Step([5])), (2, Step([9], [-0.5], [[(9, -0.5), (3, -2.0)]]))]
    # three steps of request 1 while the writer was busy: one item, with only the two new tokens
    items = ipc.event_items([(1, Step([5, 6])), (1, Step([5, 6, 7]))], dict(sent))
    assert items == [["s", 1, 1, [6, 7], 0, None, None]]
    assert across([(1, Step([5, 6])), (1, Step([5, 6, 7]))]) == [(1, Step([5, 6, 7]))]
    assert across([(2, Step([9, 4], [-0.5, -1.0], [[(9, -0.5), (3, -2.0)], [(4, -1.0)]]))]) == \
        [(2, Step([9, 4], [-0.5, -1.0], [[(9, -0.5), (3, -2.0)], [(4, -1.0)]]))]
    done = Completion(token_ids=[5, 6], text="ab", finish_reason="stop")
    assert across([(1, Step([5, 6, 7, 8])), (1, Done(done)), (2, Failed(503, "lost"))]) == \
        [(1, Step([5, 6, 7, 8])), (1, Done(done)), (2, Failed(503, "lost"))]
    assert sent == {} and streams.tokens == {}  # ended requests are forgotten on both sides


def test_a_frame_over_the_bound_is_refused_before_it_is_read():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(struct.pack(">I", ipc.MAX_FRAME + 1))
        with pytest.raises(ipc.FrameError, match="exceeds"):
            ipc.read_frame(ours)
        theirs.sendall(struct.pack(">I", 2) + b"[]")
        with pytest.raises(ipc.FrameError, match="not a JSON object"):
            ipc.read_frame(ours)
        theirs.close()
        assert ipc.read_frame(ours) is None  # the end of the stream


# ---------------------------------------------------------------- both ends in one process
class FakeRank:
    """The rank a bridge serves (`bridge.Served`): always ready, with a real engine loop."""

    def __init__(self, engine: ScriptedEngine):
        self.rank, self.state, self.metrics = 0, "ready", metrics()
        self.loop: EngineLoop | None = EngineLoop(engine, max_batch=4, max_len=64, metrics=self.metrics,
                                                   idle_seconds=0.05)
        self.ready = True

    def verdict(self) -> Verdict:
        return Verdict(True, self.ready, "" if self.ready else "rank 1 is loading", {0: True})

    def ready_loop(self) -> EngineLoop:
        if not self.ready:
            raise Unavailable("rank 1 is loading")
        assert self.loop is not None
        return self.loop

    def shards(self) -> ShardsResponse:
        return ShardsResponse(model="m", replica=0, ready=self.ready, reason="", ranks=[])

    def exposition(self, ready: bool) -> bytes:
        return self.metrics.exposition(None, ready)


class Apart:
    """A bridge and its client over a socket pair, the engine loop on a thread of its own."""

    def __init__(self, scripts: list, stale_seconds: float = ipc.STALE_SECONDS):
        self.engine = ScriptedEngine(scripts)
        self.rank = FakeRank(self.engine)
        self.ours, self.theirs = socket.socketpair()
        self.bridge = Bridge(self.ours, self.rank)
        self.client = EngineClient(0, stale_seconds=stale_seconds)
        self.thread = threading.Thread(target=self.rank.loop.run, daemon=True)  # type: ignore[union-attr]

    async def __aenter__(self) -> Apart:
        self.bridge.start()
        self.thread.start()
        await self.client.connect(self.theirs)
        await until("the first status", lambda: self.client.status is not None)
        return self

    async def __aexit__(self, *_) -> None:
        self.rank.loop.close()  # type: ignore[union-attr]
        self.bridge.close()
        self.thread.join(60)
        if self.client.writer is not None:
            self.client.writer.close()

    def pending(self, prompt: int, new: int, stream: bool) -> Pending:
        return Pending(req(prompt, new), Sink(asyncio.get_running_loop(), stream), "cmpl-test")


async def event(pending: Pending):
    return await asyncio.wait_for(pending.sink.queue.get(), 60)


async def test_requests_cross_the_pipe_and_are_answered_streamed_refused_and_counted():
    async with Apart(["ok", "ok"]) as apart:
        client = apart.client
        assert client.verdict() == Verdict(True, True, "", {0: True}) and client.state == "ready"
        streamed, whole, never = apart.pending(3, 4, True), apart.pending(3, 4, False), apart.pending(60, 10, False)
        await client.ready_link().submit([streamed, whole, never])
        assert await event(never) == Failed(400, "never fits")  # refused by the engine's check
        assert await event(streamed) == Step([7, 8])
        assert await event(streamed) == Done(Completion(token_ids=[7, 8], text="ab", finish_reason="length"))
        assert isinstance(await event(whole), Done) and whole.sink.queue.empty()  # no Steps: it does not stream
        client.outcome("rejected")  # a request the HTTP side refused itself
        await until("counted by the engine process's metrics", lambda: apart.rank.metrics.m.get(
            "shard_requests", outcome="rejected")._value.get() == 2)
        assert (await client.shards()).model == "m"
        assert b'shard_requests_total{group="0",model="m",outcome="completed"' in await client.exposition(True)
        assert client.pending == {} and apart.bridge.live == {}  # nothing is kept for ended requests


async def test_a_group_that_cannot_take_requests_refuses_them_all():
    async with Apart([]) as apart:
        apart.rank.ready = False
        first, second = apart.pending(3, 4, False), apart.pending(3, 4, False)
        with pytest.raises(Unavailable, match="rank 1 is loading"):
            await apart.client.submit([first, second])
        assert apart.client.pending == {} and apart.bridge.live == {}
        await until("the status says so", lambda: not apart.client.verdict().ready)
        with pytest.raises(Unavailable, match="rank 1 is loading"):
            apart.client.ready_link()


async def test_a_cancelled_request_leaves_the_engine_at_its_next_step():
    async with Apart(["join"]) as apart:
        running, waiting = apart.pending(3, 12, True), apart.pending(3, 2, False)
        await apart.client.submit([running])
        assert await event(running) == Step([7, 8])  # it runs, in row 0
        await apart.client.submit([waiting])
        apart.client.cancel(running)
        apart.client.cancel(waiting)
        cancelled = apart.rank.metrics.m.get("shard_requests", outcome="cancelled")._value
        await until("both cancelled in the engine process", lambda: cancelled.get() == 2)
        apart.engine.tick.release()  # the next step boundary: row 0 is handed back
        await until("the engine was told", lambda: [0] in apart.engine.cancelled)
        assert not apart.rank.loop.waiting and apart.bridge.live == {}  # type: ignore[union-attr]
        apart.engine.finish.set()
        apart.engine.tick.release()


async def test_when_the_http_process_goes_its_requests_are_cancelled():
    async with Apart(["join"]) as apart:
        running = apart.pending(3, 12, True)
        await apart.client.submit([running])
        assert await event(running) == Step([7, 8])
        apart.client.writer.close()  # type: ignore[union-attr]  # the HTTP process exits
        await until("the bridge saw it", apart.bridge.gone.is_set)
        assert apart.rank.metrics.m.get("shard_requests", outcome="cancelled")._value.get() == 1
        apart.engine.tick.release()
        await until("the engine was told", lambda: [0] in apart.engine.cancelled)
        apart.engine.finish.set()
        apart.engine.tick.release()


async def test_when_the_engine_process_goes_open_requests_fail_and_the_probes_say_so():
    async with Apart(["join"]) as apart:
        client = apart.client
        gone = asyncio.Event()
        client.on_gone = gone.set
        running = apart.pending(3, 12, True)
        await client.submit([running])
        assert await event(running) == Step([7, 8])
        apart.ours.shutdown(socket.SHUT_RDWR)  # the engine process dies
        await asyncio.wait_for(gone.wait(), 60)
        assert await event(running) == Failed(503, "the group failed: the engine process closed its pipe (it exited)")
        verdict = client.verdict()
        assert not verdict.alive and not verdict.ready and "engine process is gone" in verdict.reason
        assert client.state == "failed"
        with pytest.raises(Unavailable, match="engine process is gone"):
            client.ready_link()
        with pytest.raises(Unavailable):
            await client.shards()
        apart.engine.finish.set()
        apart.engine.tick.release()


async def test_an_engine_process_that_stops_reporting_is_not_alive():
    ours, theirs = socket.socketpair()
    with ours:
        client = EngineClient(0, stale_seconds=0.3)
        await client.connect(theirs)
        assert client.verdict() == Verdict(True, False, "the leader's engine process is starting", {})
        ours.sendall(ipc.encode({"op": "status", "state": "ready", "alive": True, "ready": True, "reason": "",
                                 "ranks_alive": [[0, True]]}))
        await until("ready", lambda: client.verdict().ready)
        await until("stale", lambda: not client.verdict().alive)  # nothing since
        assert "engine process has not reported for" in client.verdict().reason
        client.writer.close()  # type: ignore[union-attr]


# ---------------------------------------------------------------- a served group's processes
def http_process(rank_pid: int) -> int:
    (pid,) = [p for p in children(rank_pid) if cmdline(p).startswith(b"shard-worker-http ")]
    return pid


@pytest.mark.slow
def test_the_leader_serves_from_a_process_of_its_own_and_each_dies_with_the_other(tiny_model, tmp_path):
    """The leader's HTTP process is a child of its engine process. SIGSTOP the engine process:
    /health and /ready fail, saying it has not reported. Kill the HTTP process: the rank exits with
    status 1 and the group is restarted. Kill the engine process: its HTTP process is gone with it."""
    yaml_file = sharded_model_yaml(tmp_path / "m.yaml", tiny_model, name="apart", tensor=1, pipeline=1)
    with shardctl_run(yaml_file, "apart", "--devices", "localhost:1GiB", "--restarts", "2") as server:
        engine = server.ranks()[0]
        http = http_process(engine)
        assert server.complete(prompt=[1, 2, 3], max_tokens=3, temperature=0)["usage"]["completion_tokens"] == 3

        os.kill(engine, signal.SIGSTOP)
        try:
            unhealthy = wait_for("/health fails", lambda: (r := get(server.url + "/health")) is not None
                                 and r.status_code == 503 and r, timeout=60)
            assert "engine process has not reported for" in unhealthy.json()["reason"]
            assert get(server.url + "/ready").status_code == 503
        finally:
            os.kill(engine, signal.SIGKILL)  # stopped: its group is lost anyway
            os.kill(engine, signal.SIGCONT)
        wait_for("its HTTP process is gone with it", lambda: not alive(http), timeout=30)
        wait_for("a new group", lambda: (r := server.ranks()) and r.get(0) not in (None, engine), timeout=120)
        wait_for("ready again", lambda: (r := get(server.url + "/ready")) is not None and r.status_code == 200,
                 timeout=180)

        engine = server.ranks()[0]
        os.kill(http_process(engine), signal.SIGKILL)
        wait_for("the rank exits", lambda: not alive(engine), timeout=60)


@pytest.mark.slow
def test_a_leader_whose_http_process_cannot_read_the_tokenizer_exits_78(tiny_model, tmp_path):
    """The HTTP process checks the tokenizer (the engine never reads it) and exits with
    EXIT_CONFIG; the rank exits with that status, so `shardctl run` does not restart it."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "tokenizer.json").write_text("{")
    plan = plan_local(model, 1, 1, max_model_len=64, devices="localhost:1GiB", device_kind="cpu")
    lines: list[str] = []
    code = run_local(plan, model, port=free_port(), restarts=2, ready_timeout=120, out=lines.append,
                     err=lines.append, log_dir=tmp_path / "logs")
    text = "\n".join(lines)
    assert code == 3, text
    assert "rank 0 exited with status 78 (a restart would fail the same way)" in text, text
    assert "cannot serve: " in text and "the HTTP process exited with status 78" in text, text
