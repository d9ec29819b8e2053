"""The pipeline schedule cannot deadlock under NCCL's point-to-point semantics.

The real ranks (`Worker.start`, the engine's `Runner.run` / `Runner.relay`, the pipeline's `Link`) run as
threads over `rendezvous.Fabric`, where a send completes only together with its receive, matching
ignores tags, and a rank's operations run in order (see rendezvous.py). Passes of several units (a
first batch of prompts of different lengths, cut into micro-batches and chunks) and
continuous-batching joiners (several joining at one step boundary) at PP=2 and PP=3 must finish,
with HF transformers' tokens and logits. A schedule that could wait in a circle fails at once with
what every rank waits for; `test_the_fabric_finds_a_circular_wait` shows that it does.
"""

from __future__ import annotations

import threading
import traceback

import pytest
import torch

from shard_contract.env import WorkerEnv
from shard_worker.comm.dist import Topology
from shard_worker.rank.runtime import Worker

from .conftest import make_plan
from .pool import ContinuousJob, _run_continuous, _texts
from .rendezvous import Deadlock, Fabric, RendezvousComm
from .test_parallel import assert_matches_hf, hf_greedy

pytestmark = pytest.mark.slow

JOIN_TIMEOUT = 120.0  # a safety net: a circular wait is found at once, not by this timeout
LONG = {"prompt_ids": [3, 17, 42, 99, 7, 200, 64, 11], "max_new_tokens": 12, "ignore_eos": True}


def arrival(prompt: list[int], new_tokens: int) -> dict:
    return {"prompt_ids": prompt, "max_new_tokens": new_tokens, "ignore_eos": True}


def run_group(plan, model_dir, lead) -> tuple[object, list]:
    """Every rank of `plan` as a thread over one fabric: rank 0 runs `lead(worker)` and shuts the
    group down, the others follow. Returns what `lead` returned and every rank's last output."""
    fabric = Fabric(plan.world_size)
    for _ in range(plan.world_size):
        fabric.join()
    led, outputs, errors = [None], [None] * plan.world_size, {}

    def rank_main(rank: int) -> None:
        try:
            env = WorkerEnv(rank=rank, world_size=plan.world_size, tp_size=plan.tensor_parallel,
                            pp_size=plan.pipeline_parallel, plan_file="(in memory)", model_dir=str(model_dir))
            worker = Worker.start(env, plan, connect=fabric.connect)
            if rank == 0:
                led[0] = lead(worker)
                worker.engine.shutdown()
            else:
                worker.engine.follow()
            outputs[rank] = worker.engine.last_output
        except BaseException as err:  # noqa: BLE001 -- reported below, with the fabric's state
            errors[rank] = err if isinstance(err, Deadlock) else AssertionError(traceback.format_exc())
            fabric.fail(f"rank {rank} failed: {type(err).__name__}: {err}")
        finally:
            fabric.leave(rank)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(plan.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    if any(t.is_alive() for t in threads):
        fabric.fail(f"timed out after {JOIN_TIMEOUT:.0f} s; queue heads: {fabric.heads()}")
        raise AssertionError(fabric.broken)
    if errors:
        raise next(iter(errors.values()))
    return led[0], outputs


def test_the_fabric_finds_a_circular_wait():
    """Two ranks that each send before they receive: fine on gloo (buffered), a circular wait on
    NCCL. The same exchange with one side receiving first completes."""
    def exchange(first_sends: tuple[bool, bool]) -> list:
        fabric = Fabric(2)
        results, errors = [None, None], []

        def rank_main(rank: int) -> None:
            comm = RendezvousComm(fabric, Topology(rank=rank, tp=1, pp=2), acct=None)
            mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
            try:
                if first_sends[rank]:
                    pending = comm.isend(mine, 1 - rank, tag=1)
                    comm.recv(theirs, 1 - rank, tag=2)
                    pending.work.wait()
                else:
                    comm.recv(theirs, 1 - rank, tag=1)
                    comm.isend(mine, 1 - rank, tag=2).work.wait()
                results[rank] = theirs.tolist()
            except Deadlock as err:
                errors.append(str(err))
            finally:
                fabric.leave(rank)
        fabric.join()
        fabric.join()
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return errors or results

    errors = exchange((True, True))
    assert errors and "deadlock" in errors[0] and "rank 0: #1 send to 1" in errors[0], errors
    assert exchange((True, False)) == [[1.0] * 4, [0.0] * 4]


@pytest.mark.parametrize("pp", [2, 3])
def test_a_batch_of_several_units_runs_under_rendezvous_semantics(checkpoint, hf_model, pp):
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 1, pp, max_len=64, batch=3)
    prompts = [[3, 17, 42, 99, 7, 200, 64, 11], [5, 9, 33], [8, 1, 77, 120, 4, 61]]
    from shard_contract.wire import GenerateRequest

    requests = [GenerateRequest(prompt_ids=p, max_new_tokens=4, ignore_eos=True) for p in prompts]
    # logits come back too: float32 [rows, vocab] slices, over the control channel
    out, _ = run_group(plan, model_dir, lambda worker: worker.engine.generate(requests, return_logits=True))
    assert_matches_hf([{"output": out}], hf_model(model_dir), prompts)


@pytest.mark.parametrize("pp", [2, 3])
def test_joiners_run_under_rendezvous_semantics(checkpoint, hf_model, pp):
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 1, pp, max_len=64, batch=3)
    # two arrive at the first step boundary (both join at once: several joiners' units in one
    # pass), one more at the third, taking the row the first short one frees
    short, other, late = arrival([5, 9, 33], 2), arrival([8, 1, 77, 120, 4, 61], 3), arrival([2, 4, 6, 8], 3)
    job = ContinuousJob([LONG], arrivals={1: [short, other], 3: [late]})
    (_, events, _), outputs = run_group(plan, model_dir,
                                     lambda worker: _run_continuous(worker.engine, job, _texts(worker)))
    joins = [e for e in events if e[0] == "join"]
    assert [step for _, step, _, _ in joins] == [1, 1, 3]
    model = hf_model(model_dir)
    completions = outputs[0].completions
    for request, completion in zip([LONG, short, other, late], completions, strict=True):
        assert completion.token_ids == hf_greedy(model, request["prompt_ids"], request["max_new_tokens"])
