"""`python -m shard_worker`: one rank of a sharded group, configured only by its environment
(`shard_contract.env.WorkerEnv`) and the Plan file it names. The same entry point runs in a
pod and as a local process of `shardctl`.

Without SHARD_TASK, every rank serves HTTP: `serve` composes the rank's lifecycle
(`rank/lifecycle.py`) and its app (`serving/app.py`: health, readiness and metrics on all). The
leader (rank 0) serves them and the OpenAI-compatible routes (`serving/routes.py`) from an HTTP
process of its own (`serving/front.py`, unless SHARD_HTTP_PROCESS=0), so that HTTP work never
takes the engine's GIL. With it, the leader (rank 0) runs that one-shot task and
writes the result to SHARD_RESULT; every other rank follows the leader's commands until it says
shutdown. `ps` shows each rank as `shard-worker model=... group=... rank=... port=...`.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from pathlib import Path

# Before torch is imported (its OpenMP runtime reads this once): torch's intra-op threads sleep as
# soon as a parallel region ends instead of spinning on for milliseconds. They share the cores with
# the decode kernel's own threads (kernels.py), which waited for the spinners' time slices: TP=1
# with 2 threads decoded slower than with 1 (0.42 of the 2-core limit in bfloat16). Set it to
# override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Also before torch allocates: its CPU allocator puts every buffer of 2 MiB or more on transparent
# huge pages (2 MiB aligned, madvise MADV_HUGEPAGE). Decode streams every weight once a token: on
# 4 KiB pages the hardware prefetchers stop at each page boundary, and bfloat16 weights streamed
# 4-11% slower (Zen 4, bench/decode.py). A kernel with THP off ("never") ignores it. Set it to 0
# to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from shard_contract.checkpoint import CheckpointError
from shard_contract.env import (
    EXIT_CONFIG,
    EXIT_FAILED,
    HTTP_PROCESS_ENV,
    RESULT_ENV,
    TASK_ENV,
    WorkerEnv,
    WorkerEnvError,
)
from shard_contract.plan import Plan
from shard_contract.wire import GenerateResult, GenerateTask, RankReport, ShardEntry

from .comm.dist import RendezvousError
from .engine.boundary import Hooks
from .engine.engine import RequestError
from .log import first_line, log
from .model.config import ConfigError
from .rank.runtime import PlanMismatch, Worker, freeze_loaded_objects
from .serving.text import Texts
from .serving.tokenizer import TextCodec
from .telemetry.accounting import MemorySample

# Errors whose message says it all: printed as one line, no traceback.
KNOWN_ERRORS = (CheckpointError, ConfigError, RendezvousError, RequestError, PlanMismatch)
# Of those, the ones a restart cannot fix (the process exits EXIT_CONFIG): the plan, the checkpoint
# or this process's environment is wrong (a PlanMismatch: no CUDA for a GPU rank, a memory budget
# the plan or the load exceeds). A rendezvous that timed out may succeed on a retry.
PERMANENT_ERRORS = (CheckpointError, ConfigError, PlanMismatch)


def exit_status(err: BaseException) -> int:
    return EXIT_CONFIG if isinstance(err, PERMANENT_ERRORS) else EXIT_FAILED


def process_title(env: WorkerEnv, serving: bool) -> str:
    """How `ps` shows this rank: its model, group and rank, and where a serving rank listens."""
    return f"shard-worker model={env.model_name} group={env.replica} rank={env.rank}" + \
        (f" port={env.port}" if serving else "")


def name_process(title: str) -> None:
    """Show `title` in `ps` and `top` instead of `python -m shard_worker`, with setproctitle (the
    worker extra; without it, nothing changes). Like Postgres and gunicorn, it writes the title
    over the process's argv and environment strings: /proc/PID/environ then reads empty, while
    os.environ is untouched."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(title)


def run_task(worker: Worker, task_path: str, result_path: str) -> None:
    """The leader's one-shot job: generate, gather every rank's report, write the result. The text
    is made here, as the server makes it (`text.py`): each sequence whose text meets a stop string
    is stopped at the next step boundary."""
    task = GenerateTask.model_validate_json(Path(task_path).read_text())
    codec = TextCodec.load(worker.env.model_dir)
    stops = any(r.stop for r in task.requests)
    if codec is None and stops:
        raise RequestError(f"stop strings need {Path(worker.env.model_dir) / 'tokenizer.json'}")
    texts = Texts(codec.decode if codec is not None else None)
    hooks = Hooks(admit=lambda free, col: [], step=texts.step, finished=lambda seq, done: None,
                  stopped=texts.stopped)
    out = worker.engine.generate(task.requests, hooks=hooks if stops else None)
    completions = texts.finish(task.requests, out.completions)
    group = worker.plan.group(worker.env.replica)  # the reports come in rank order
    ranks = [ShardEntry(plan=rp, report=RankReport.model_validate(report), state="ready")
             for rp, report in zip(group, worker.engine.reports(), strict=True)]
    result = GenerateResult(completions=completions, ranks=ranks,
                            prefill_seconds=out.prefill_seconds, decode_seconds=out.decode_seconds,
                            decode_steps=out.decode_steps)
    partial = Path(result_path + ".partial")
    partial.write_text(result.model_dump_json(indent=2))
    partial.replace(result_path)  # the launcher never reads half a file


def serve(env: WorkerEnv, plan: Plan, baseline: MemorySample) -> int:
    """Run this rank's server until it is told to stop (SIGTERM, SIGINT, or the leader's shutdown);
    the process then exits with the status (0, or `exit_status(err)` when its load failed)."""
    from .rank.lifecycle import Rank, RankProbes
    from .serving.app import build_app
    from .serving.limits import BoundedBodies
    from .serving.routes import OpenAIRoutes

    if not Path(env.model_dir).is_dir():
        log(env.rank, f"SHARD_MODEL_DIR {env.model_dir} is not a directory")
        return EXIT_CONFIG
    try:
        rank = Rank(env, plan, baseline, KNOWN_ERRORS, exit_status)
        if rank.leader and os.environ.get(HTTP_PROCESS_ENV, "1") != "0":
            return rank.serve_apart()  # the routes are built (and checked) by the HTTP process
        api = OpenAIRoutes(env.model_name, env.model_dir, plan.max_model_len, env.api_key_file, rank.ready_link,
                           rank.metrics, text_timeout=env.text_timeout) if rank.leader else None
        app = BoundedBodies(build_app(env.model_name, RankProbes(rank), api), env.max_body_bytes, env.read_timeout)
    except Exception as err:  # noqa: BLE001 -- no such rank in the plan; an unreadable tokenizer or API key
        log(env.rank, f"cannot serve: {first_line(err)}")
        return EXIT_CONFIG
    return rank.serve(app)


def main() -> int:
    # A crash below Python (a kernel's fault, an abort in a collective library) prints every
    # thread's stack into the rank's log: else a dead follower leaves only "Connection closed by
    # peer" in its leader's.
    faulthandler.enable()
    serving = not os.environ.get(TASK_ENV)
    if serving:  # before the baseline: the server's libraries belong to the bare process
        from .rank import lifecycle  # noqa: F401 -- imported for their weight, used by serve()
        from .serving import app, routes  # noqa: F401 -- imported for their weight, used by serve()
    baseline = MemorySample.take()  # the bare process: interpreter, torch, this package
    try:
        env = WorkerEnv.from_env()
        plan = Plan.from_json(Path(env.plan_file).read_text())
    except (WorkerEnvError, OSError, ValueError) as err:
        print(f"shard_worker: {err}", file=sys.stderr)
        return EXIT_CONFIG
    name_process(process_title(env, serving))
    if serving:  # every rank serves HTTP (the API on rank 0) until it is stopped
        return serve(env, plan, baseline)
    start = time.perf_counter()
    try:
        worker = Worker.start(env, plan, baseline)
    except KNOWN_ERRORS as err:
        log(env.rank, f"{type(err).__name__}: {err}")
        return exit_status(err)
    log(env.rank, worker.loaded(time.perf_counter() - start))
    freeze_loaded_objects()
    try:
        if not worker.topo.is_leader:
            worker.engine.follow()
            return 0
        try:
            run_task(worker, os.environ[TASK_ENV], os.environ[RESULT_ENV])
        except RequestError as err:
            log(env.rank, f"RequestError: {err}")
            return 1
        finally:
            worker.engine.shutdown()
        return 0
    finally:
        worker.close()


if __name__ == "__main__":
    sys.exit(main())
