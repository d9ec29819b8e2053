"""A pool of long-lived rank processes for the multi-process worker tests.

Starting a rank is mostly `import torch` (seconds each on these machines) and the tests run dozens
of groups, so each pool process imports torch once and then plays one rank of group after group:
per job it joins a fresh gloo group on a fresh port, builds its rank with the same `Worker.start`
that `python -m shard_worker` uses, runs the job, and leaves the group. The entry point itself is
exercised by the launcher tests.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from dataclasses import dataclass, field
from typing import Any

JOB_TIMEOUT = 240.0


class JobFailed(AssertionError):
    def __init__(self, rank: int, kind: str, message: str, trace: str):
        super().__init__(f"rank {rank}: {kind}: {message}\n{trace}")
        self.rank, self.kind, self.message = rank, kind, message


@dataclass
class GenerateJob:
    requests: list[dict]
    return_logits: bool = True
    env: dict | None = None  # set in the rank's environment for this job only


@dataclass
class ContinuousJob:
    """A continuous generate, as the server runs it: `requests` start it, and `arrivals[k]` are
    queued at the k-th decode step boundary, to join as the batcher lets them (in queue order,
    when a row is free and they fit). Deterministic: the steps, not the clock, decide."""

    requests: list[dict]
    arrivals: dict[int, list[dict]]
    cancels: dict[int, list[int]] = field(default_factory=dict)  # step -> sequence indices whose clients leave
    env: dict | None = None  # set in the rank's environment for this job only


@dataclass
class TensorsJob:
    """Load only, and hand back every tensor the rank holds."""


def _serve(inbox: mp.Queue, outbox: mp.Queue) -> None:
    import torch

    torch.set_num_threads(1)
    while True:
        item = inbox.get()
        if item is None:
            return
        env_json, plan_json, job = item
        try:
            outbox.put(("ok", _run(env_json, plan_json, job)))
        except BaseException as err:  # noqa: BLE001 -- report everything; the parent decides
            outbox.put(("error", (type(err).__name__, str(err), traceback.format_exc())))


def _run(env_json: str, plan_json: str, job: Any) -> dict:
    import os

    from shard_contract.env import WorkerEnv
    from shard_contract.plan import Plan
    from shard_contract.wire import GenerateRequest
    from shard_worker.engine.boundary import Hooks
    from shard_worker.rank.runtime import Worker

    saved = dict(os.environ)
    os.environ.update(getattr(job, "env", None) or {})
    try:
        worker = Worker.start(WorkerEnv.model_validate_json(env_json), Plan.from_json(plan_json))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        import torch

        # float32 matmul precision as the rank runs it: "highest" (no TF32 on a GPU), or float32
        # results are not comparable with HF's
        result: dict[str, Any] = {"layout": worker.stage.layout, "shared_memory": worker.comm.shm is not None,
                                  "float32_matmul": torch.get_float32_matmul_precision()}
        if isinstance(job, TensorsJob):
            result["tensors"] = {k: v.clone() for k, v in worker.stage.tensors().items()}
        if worker.topo.is_leader:
            texts = _texts(worker)
            if isinstance(job, GenerateJob):
                requests = [GenerateRequest.model_validate(r) for r in job.requests]
                # With stop strings, as `shardctl generate` runs a task: the text side stops them.
                hooks = Hooks(admit=lambda free, col: [], step=texts.step, finished=lambda seq, done: None,
                              stopped=texts.stopped) if any(r.stop for r in requests) else None
                worker.engine.generate(requests, return_logits=job.return_logits, hooks=hooks)
            if isinstance(job, ContinuousJob):
                requests, result["events"], result["trace"] = _run_continuous(worker.engine, job, texts)
                result["requests"] = [r.model_dump() for r in requests]  # in order of arrival in the engine
            output = worker.engine.last_output
            if isinstance(job, (GenerateJob, ContinuousJob)) and output is not None:
                output.completions = texts.finish(requests, output.completions)
            result["reports"] = worker.engine.reports()
            blocks = worker.engine.blocks.pool  # the leader's KV-block bookkeeping after the job
            result["kv"] = {"preemptions": worker.engine.preemptions, "free": blocks.free_blocks,
                            "blocks": blocks.num_blocks, "prefix_hits": blocks.hits, "prefix_queries": blocks.queries}
            worker.engine.shutdown()
        else:
            worker.engine.follow()
        result["output"] = worker.engine.last_output
        result["merged_passes"] = worker.stage.merged_passes  # chunks that rode with a decode step in one pass
        return result
    finally:
        worker.close()


def _texts(worker):
    """The leader's text side (`text.Texts`) over the checkpoint's tokenizer."""
    from shard_worker.serving.text import Texts
    from shard_worker.serving.tokenizer import TextCodec

    codec = TextCodec.load(worker.env.model_dir)
    return Texts(codec.decode if codec is not None else None)


def _run_continuous(engine, job: ContinuousJob, texts) -> tuple[list, list[tuple], list[tuple]]:
    """Drive `job` through the engine's hooks with the batcher's own admission rule and the text
    side's stop strings (`texts`); returns every request in order of arrival, and what happened,
    in order: ("join", step, column, sequence index), ("finished", step, index, row) and ("cancel",
    step, index); and a trace: ("free_blocks", step, the KV pool's free blocks at that boundary,
    after its cancels) and ("tokens", step, indices of the sequences that took a token in a step)."""
    from shard_contract.wire import GenerateRequest
    from shard_worker.engine.boundary import Hooks
    from shard_worker.serving.batcher import take_joiners

    def parse(requests: list[dict]) -> list:
        return [GenerateRequest.model_validate(r) for r in requests]

    arrivals = {step: parse(requests) for step, requests in job.arrivals.items()}
    order = parse(job.requests)  # every request, by sequence index
    waiting: list = []
    events: list[tuple] = []
    trace: list[tuple] = []
    steps = [0]  # step boundaries passed
    started = [len(job.requests)]  # sequences the engine has started: the next one's index

    def admit(free_rows: int, col: int) -> list:
        trace.append(("free_blocks", steps[0], engine.blocks.pool.free_blocks))
        waiting.extend(arrivals.pop(steps[0], []))
        chosen = take_joiners(waiting, free_rows, col, engine.max_len, engine.blocks.admission, engine.blocks.room())
        joining = [waiting[i] for i in chosen]
        for i in reversed(chosen):
            del waiting[i]
        order.extend(joining)
        for _ in joining:
            events.append(("join", steps[0], col, started[0]))
            started[0] += 1
        steps[0] += 1
        return joining

    def finished(seq, completion) -> None:
        events.append(("finished", steps[0], seq.index, seq.row))

    def cancelled() -> list[int]:  # asked before admit() at each boundary (a sequence not started: none)
        leaving = [index for index in job.cancels.get(steps[0], []) if index < started[0]]
        events.extend(("cancel", steps[0], index) for index in leaving)
        return leaving

    def step(seqs) -> None:
        trace.append(("tokens", steps[0], [seq.index for seq in seqs]))
        texts.step(seqs)

    engine.generate(list(order), hooks=Hooks(admit=admit, step=step, finished=finished,
                                             cancelled=cancelled, stopped=texts.stopped))
    assert not waiting and not arrivals, "some arrivals never joined"
    return order, events, trace


class RankPool:
    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self._procs: list[tuple[Any, mp.Queue, mp.Queue]] = []

    def _grow(self, n: int) -> None:
        while len(self._procs) < n:
            inbox, outbox = self._ctx.Queue(), self._ctx.Queue()
            proc = self._ctx.Process(target=_serve, args=(inbox, outbox), daemon=True)
            proc.start()
            self._procs.append((proc, inbox, outbox))

    def run(self, plan, model_dir, job: Any, timeout: float = JOB_TIMEOUT) -> list[dict]:
        """Run `job` on every rank of replica 0 of `plan`; results in rank order."""
        from shard_contract.env import WorkerEnv
        from shard_operator.local.launcher import free_port

        world = plan.world_size
        self._grow(world)
        port = free_port()
        for rank in range(world):
            env = WorkerEnv(rank=rank, world_size=world, master_port=port, tp_size=plan.tensor_parallel,
                            pp_size=plan.pipeline_parallel, plan_file="(in memory)", model_dir=str(model_dir),
                            rendezvous_timeout=60)
            self._procs[rank][1].put((env.model_dump_json(), plan.to_json(), job))
        results, errors = [], []
        for rank in range(world):
            try:
                status, value = self._procs[rank][2].get(timeout=timeout)
            except queue.Empty:
                self.close()  # a rank hung: the pool is no longer in step
                raise AssertionError(f"rank {rank} did not finish the job within {timeout:.0f}s") from None
            if status == "error":
                errors.append(JobFailed(rank, *value))
            results.append(value)
        if errors:
            raise errors[0]
        return results

    def close(self) -> None:
        for proc, inbox, _ in self._procs:
            if proc.is_alive():
                inbox.put(None)
        for proc, _, _ in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._procs.clear()
