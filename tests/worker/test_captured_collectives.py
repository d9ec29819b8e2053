"""The tensor-parallel collectives inside a captured decode step are counted at every replay
(`graphs.DecodeGraphs`, `Comm.recording`, `Accounting.replayed`), on the CPU.

Rank 0 of a TP=2 stage runs in this one process over torch's fake process group (every collective
returns at once, its shapes right, its values not: the checks are on the bookkeeping). CUDA's
capture is replaced by a stand-in that runs the step's Python once, as a capture does, and then
counts replays: what is faked is only the device; the recording, the tape per bucket and the
counting at each replay are the product's. The real capture runs in the CUDA tests of
test_decode_graphs.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from shard_worker.comm.dist import Comm, Topology
from shard_worker.engine.graphs import DecodeGraphs
from shard_worker.model.config import ModelConfig
from shard_worker.model.loader import load_stage
from shard_worker.model.model import Stage
from shard_worker.model.slices import Layout
from shard_worker.model.step import KVCache, Rotary
from shard_worker.telemetry.accounting import Accounting

ROWS, MAX_LEN = 3, 24


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


class FakeGraph:
    """torch.cuda.CUDAGraph's stand-in: a replay runs nothing, and is counted."""

    replays = 0

    def replay(self) -> None:
        FakeGraph.replays += 1


class FakeStream:
    def wait_stream(self, other) -> None:
        pass


def fake_cuda_capture(monkeypatch) -> None:
    """After everything is imported (transformers reads torch.cuda's names as it loads)."""
    FakeGraph.replays = 0
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None, capture_error_mode=None:
                        contextlib.nullcontext())


def tp2_rank0(model_dir) -> tuple[Stage, KVCache, Rotary, Comm]:
    config = ModelConfig.from_dir(model_dir)
    comm = Comm(Topology(rank=0, tp=2, pp=1), Accounting())
    layout = Layout(config, tp=2, tp_rank=0, layers=(0, config.num_layers), embeds=True, has_lm_head=True)
    stage = Stage(layout, comm, torch.float32, torch.device("cpu"))
    load_stage(stage, model_dir)
    cache = KVCache(config.num_layers, ROWS, layout.kv_heads, MAX_LEN, config.head_dim, torch.float32, stage.device)
    return stage, cache, Rotary(config, MAX_LEN, stage.device), comm


def step(graphs: DecodeGraphs, acct: Accounting, col: int) -> tuple[dict[str, int], float]:
    """One decode step of every row at `col`: the bytes per op and the seconds it counted."""
    before = acct.snapshot()
    with torch.inference_mode():
        graphs.run(0, ROWS, col, torch.full((ROWS, 1), 5), torch.zeros(ROWS, dtype=torch.int64),
                   graphs.cache.contiguous)
    after = acct.snapshot()
    return ({op: after.comm_bytes[op] - before.comm_bytes[op] for op in after.comm_bytes
             if after.comm_bytes[op] != before.comm_bytes[op]}, after.comm_total - before.comm_total)


def test_a_replayed_step_counts_the_collectives_an_eager_step_counts(checkpoint, fake_world, monkeypatch):
    """Each replay of a captured step counts the bytes the eager step counts as it runs its
    collectives (the embedding's all-reduce, two a layer, the vocabulary's all-gather), with no seconds of its own;
    the compile mode's recording run finds the same collectives."""
    model_dir = checkpoint("llama")
    layers = ModelConfig.from_dir(model_dir).num_layers
    stage, cache, rotary, comm = tp2_rank0(model_dir)
    acct = comm.acct
    eager = DecodeGraphs(stage, cache, rotary, comm, "eager", min_length=8)
    eager_bytes, eager_seconds = step(eager, acct, col=4)
    assert set(eager_bytes) == {"all_reduce", "all_gather"} and eager_seconds > 0
    hidden = stage.config.hidden_size
    # the vocabulary-parallel embedding's, then attention's and the MLP's outputs in each layer
    assert eager_bytes["all_reduce"] == (1 + 2 * layers) * ROWS * hidden * 4

    replayed = DecodeGraphs(stage, cache, rotary, comm, "eager", min_length=8)
    fake_cuda_capture(monkeypatch)
    replayed.mode = "cuda"  # captured through the stand-in above
    for col in range(4, 8):  # one capture (bucket 3 rows x 8 columns), four replays
        assert step(replayed, acct, col) == (eager_bytes, 0.0)
    assert FakeGraph.replays == 4 and replayed.captured == 1

    tape = dict.fromkeys(eager_bytes, 0)
    for op, nbytes in replayed._record(ROWS, 8):  # compile mode's eager recording of the bucket
        tape[op] += nbytes
    assert tape == eager_bytes


def test_recording_counts_only_the_raw_collectives_inside_it(fake_world):
    comm = Comm(Topology(rank=0, tp=2, pp=1), Accounting())
    t = torch.zeros(3, 5)
    with comm.recording() as tape:
        comm.all_reduce(t)  # timed and counted as it runs: not on the tape
        with comm.captured():
            comm.all_reduce(t)
            comm.all_gather(t)
    with comm.captured():
        comm.all_reduce(t)  # outside the recording
    assert tape == [("all_reduce", 60), ("all_gather", 120)]
    assert comm.acct.counters.comm_bytes["all_reduce"] == 60
