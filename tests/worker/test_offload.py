"""Offload: ranks that stream some or all of their layers compute exactly what fully resident ranks
compute -- the same float32 logits, bit for bit, and HF transformers' greedy tokens -- at TP=1,
TP=2, PP=2 and TP=2 x PP=2, with 25% and 100% of the layers streamed; each rank counts what it
streamed; a rank holds its resident plan, not the model, while it serves.

A CPU rank computes on the checkpoint mapped in place (row slices, and TP's column slices as
strided views) and copies only what it cannot: tensors of another dtype than the runtime's, or
whose data are misaligned; what it copies is what the plan predicts as staging."""

from __future__ import annotations

import pytest
import torch

from shard_contract.wire import GenerateRequest, GenerateTask
from shard_operator.local.launcher import run_generate
from tests.support.checkpoints import write_checkpoint
from tests.support.offload import streaming_plan

from .conftest import SHAPE
from .test_parallel import PROMPT, assert_matches_hf, run_greedy

pytestmark = pytest.mark.slow

@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_streamed_layers_compute_what_resident_ones_do(pool, deep, hf_model, tp, pp):
    resident = run_greedy(pool, streaming_plan(deep, tp, pp, 0.0), deep, [PROMPT])
    reference = torch.stack([step[0] for step in resident[0]["output"].logits])
    for fraction in (0.25, 1.0):
        plan = streaming_plan(deep, tp, pp, fraction)
        streamed = [len(r.offload.layers) if r.offload else 0 for r in plan.ranks if r.tp_rank == 0]
        assert sum(streamed) == fraction * SHAPE["num_layers"], streamed
        results = run_greedy(pool, plan, deep, [PROMPT])
        assert_matches_hf(results, hf_model(deep), [PROMPT])
        logits = torch.stack([step[0] for step in results[0]["output"].logits])
        assert torch.equal(logits, reference), f"{fraction:.0%} streamed: logits differ from the resident run"
        for rank, report in enumerate(results[0]["reports"]):  # in rank order
            predicted, off = plan.rank_plan(0, rank).predicted_bytes, plan.rank_plan(0, rank).offload
            if off is None:
                assert report["streamed_bytes"] == 0
                continue
            # whole layers, at least one forward pass per generated token, through `prefetch` slots
            per_layer = off.streamed_bytes // len(off.layers)
            assert report["streamed_bytes"] % per_layer == 0
            assert report["streamed_bytes"] >= 5 * off.streamed_bytes
            assert report["stream_seconds"] > 0 and report["stall_seconds"] >= 0
            # computed on the mapped checkpoint in place (TP's column slices too): no staging
            assert off.copied_bytes == 0
            assert report["allocated_bytes"]["staging"] == predicted.staging == 0
            assert report["allocated_bytes"]["weights"] == predicted.weights


def _stages(model_dir, streamed, tp: int = 1, tp_rank: int = 0, dtype: torch.dtype = torch.float32,
            resident: bool = True):
    """A whole rank (every layer resident; None without `resident`) and one that streams
    `streamed`, both loaded, and the latter's accounting (a streamer still to be made)."""
    from shard_worker.comm.dist import Comm, Topology
    from shard_worker.model.config import ModelConfig
    from shard_worker.model.loader import load_stage
    from shard_worker.model.model import Stage
    from shard_worker.model.slices import Layout
    from shard_worker.telemetry.accounting import Accounting

    config = ModelConfig.from_dir(model_dir)
    layout = Layout(config, tp=tp, tp_rank=tp_rank, layers=(0, config.num_layers), embeds=True, has_lm_head=True)
    acct = Accounting()
    comm = Comm(Topology(rank=tp_rank, tp=tp, pp=1), acct)  # no collective runs: no group needed
    whole = Stage(layout, comm, dtype, torch.device("cpu")) if resident else None
    if whole is not None:
        load_stage(whole, model_dir)
    stage = Stage(layout, comm, dtype, torch.device("cpu"), streamed=streamed)
    load_stage(stage, model_dir)
    return whole, stage, acct


def _borrow_and_compare(streamer, stage, whole, order) -> None:
    """Borrow each layer of `order` in turn: its projections are the resident rank's, bit for bit."""
    for j in order:
        layer = stage.layers[j]
        with streamer.lend(layer):
            for name, projection in layer.projections().items():
                assert torch.equal(_matrix(projection), whole.tensors()[f"layers.{j}.{name}.weight"]), (j, name)
        assert layer.attn.qkv.weight.numel() == 0  # given back


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_every_borrow_gets_its_own_layer_whatever_the_order(deep, prefetch):
    """The prefetcher loads ahead in forward order; a forward pass that ends early (an error
    mid-stage) makes the next one ask out of that order, and it still gets the right weights."""
    from shard_worker.model.offload import Streamer

    off = streaming_plan(deep, 1, 1, 1.0, prefetch=prefetch).ranks[0].offload
    whole, stage, acct = _stages(deep, off.layers)
    streamer = stage.streamer = Streamer(stage, off, deep, acct).start()
    try:
        order = [0, 1, 2, 0, 1, 2, 3, 7, 8, 23, 0, 5, 5, 6, 7, 22, 23, 0, 1]
        _borrow_and_compare(streamer, stage, whole, order)
        assert acct.counters.streamed_bytes >= len(order) * off.streamed_bytes // len(off.layers)
    finally:
        streamer.close()


@pytest.fixture(scope="module")
def scattered(tmp_path_factory):
    """A Qwen2 checkpoint (q, k and v with biases) in 12 files, every third of them with its
    tensors' data one byte past an element boundary (an odd header length): a layer's tensors
    lie in up to two files, aligned or not."""
    from tests.support.checkpoints import misalign

    directory = write_checkpoint(tmp_path_factory.mktemp("scattered"), "qwen2", seed=11, hidden_size=64,
                                 intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=2, vocab_size=250,
                                 max_position_embeddings=256, max_shard_size="100KB")
    files = sorted(directory.glob("*.safetensors"))
    assert len(files) >= 6
    for path in files[2::3]:
        misalign(path)
    return directory


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_cpu_rank_maps_what_it_can_and_copies_the_rest(scattered, tp_rank):
    """At TP=2 (row slices of q, k, v, gate and up; column slices of o and down): every slice whose
    data are aligned is a view of its mapped file, a column slice a strided one; every misaligned
    one is copied into the slot's staging, which is exactly what the plan predicts."""
    from shard_worker.model.offload import Streamer

    rank = streaming_plan(scattered, 2, 1, 1.0).rank_plan(0, tp_rank)
    off = rank.offload
    whole, stage, acct = _stages(scattered, off.layers, tp=2, tp_rank=tp_rank)
    streamer = stage.streamer = Streamer(stage, off, scattered, acct).start()
    try:
        copied = {j: 0 for j in off.layers}
        for j in off.layers:
            for parts in streamer.parts[j].values():
                for part in parts:
                    assert (part.view is None) == (not part.entry.aligned), (j, part.piece)
                    if part.view is None:
                        copied[j] += part.nbytes
                    elif part.piece.dim == 1:  # o and down: this rank's columns, read in place
                        assert part.view.stride(0) == 2 * part.view.shape[1]
        assert 0 < sum(copied.values()) == off.copied_bytes < off.streamed_bytes
        assert streamer.nbytes == rank.predicted_bytes.staging == off.prefetch * max(copied.values())
        _borrow_and_compare(streamer, stage, whole, off.layers * 2 + [3, 0])
    finally:
        streamer.close()


def test_a_scattered_checkpoint_streams_what_resident_ranks_compute(pool, scattered, hf_model):
    resident = run_greedy(pool, streaming_plan(scattered, 2, 1, 0.0), scattered, [PROMPT])
    results = run_greedy(pool, streaming_plan(scattered, 2, 1, 1.0), scattered, [PROMPT])
    assert_matches_hf(results, hf_model(scattered), [PROMPT])
    assert torch.equal(torch.stack([step[0] for step in results[0]["output"].logits]),
                       torch.stack([step[0] for step in resident[0]["output"].logits]))


def test_another_dtype_is_copied_into_staging(tmp_path):
    """A bfloat16 checkpoint run in float32: nothing can be computed on in place, every slice is
    converted into the slot's staging, the plan's staging: a layer per slot."""
    from shard_worker.model.offload import Streamer

    directory = write_checkpoint(tmp_path, "llama", seed=5, dtype="bfloat16", **{**SHAPE, "num_layers": 6})
    rank = streaming_plan(directory, 1, 1, 1.0, dtype="float32").ranks[0]
    off = rank.offload
    whole, stage, acct = _stages(directory, off.layers)
    streamer = stage.streamer = Streamer(stage, off, directory, acct).start()
    try:
        assert all(p.view is None for j in off.layers for ps in streamer.parts[j].values() for p in ps)
        assert off.copied_bytes == off.streamed_bytes
        layer = off.streamed_bytes // len(off.layers)
        assert streamer.nbytes == rank.predicted_bytes.staging == off.prefetch * layer
        _borrow_and_compare(streamer, stage, whole, off.layers * 2)
    finally:
        streamer.close()


def _matrix(projection) -> torch.Tensor:
    """A projection's weight as one matrix (a streamed one may be row blocks of the mapped file)."""
    return torch.cat(projection.weight) if isinstance(projection.weight, tuple) else projection.weight


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("big-offload"), "llama", hidden_size=768,
                            intermediate_size=2048, num_layers=8, num_heads=12, num_kv_heads=4, vocab_size=16000,
                            max_position_embeddings=2048)


def test_a_streaming_rank_holds_its_plan_not_the_model(big):
    """Streaming every layer at TP=2, each rank of a real `python -m shard_worker` group holds its
    resident plan while it serves: its peak resident set above a bare torch stays within 1.15x
    of it and the layers it maps at a time, far below its share of the model (the page cache holds
    the streamed layers)."""
    plan = streaming_plan(big, 2, 1, 1.0, max_len=512, batch=2)
    task = GenerateTask(requests=[GenerateRequest(prompt_ids=list(range(3, 40)), max_new_tokens=8)])
    result = run_generate(plan, big, task, timeout=300)
    assert len(result.ranks) == 2
    for entry in result.ranks:
        r, rank, predicted, off = entry.report, entry.plan.rank, entry.plan.predicted_bytes, entry.plan.offload
        assert r is not None and off is not None
        assert r.allocated_bytes == {"weights": predicted.weights, "kv_cache": predicted.kv_cache,
                                     "staging": predicted.staging}
        assert predicted.weights + off.streamed_bytes > 2 * (predicted.weights + predicted.staging)
        # the resident set also holds the layers a CPU rank has mapped at a time (page cache, which
        # the plan does not count as staging): `prefetch` of them during the warm-up's largest pass
        mapped = off.prefetch * off.streamed_bytes // len(off.layers)
        assert 0 < r.resident_bytes.peak <= 1.15 * (predicted.total + mapped), (rank, r.resident_bytes, predicted)
        assert r.streamed_bytes >= 8 * off.streamed_bytes


def test_a_cpu_rank_maps_a_few_layers_at_a_time(big):
    """A streamed layer's file pages are mapped into the process while it is in a slot, and out
    once its slot takes another layer (the page cache keeps them): through two passes over every
    layer, the rank's mapped file memory grows by about its slots' layers, not the model's."""
    from shard_worker.model.offload import Streamer
    from shard_worker.telemetry.accounting import proc_status

    off = streaming_plan(big, 1, 1, 1.0, max_len=512).ranks[0].offload
    _, stage, acct = _stages(big, off.layers, resident=False)
    layer = off.streamed_bytes // len(off.layers)
    assert len(off.layers) == 8 and off.prefetch == 2 and off.copied_bytes == 0
    before, most = proc_status()["RssFile"], 0
    streamer = stage.streamer = Streamer(stage, off, big, acct).start()
    try:
        for j in off.layers * 2:
            with streamer.lend(stage.layers[j]):
                most = max(most, proc_status()["RssFile"] - before)
        # the layer computing, the next one, a page or a 2 MiB folio of their neighbours at each end
        assert layer < most <= (off.prefetch + 1) * layer + 16 * 2**20, (most, layer)
        assert acct.counters.streamed_bytes >= 16 * layer
    finally:
        streamer.close()


@pytest.mark.parametrize("populate_read", [True, False])
def test_a_layer_is_mapped_in_and_out_with_or_without_populate_read(big, populate_read):
    """`FileMaps` maps a span's pages into the process and out again; a kernel before Linux 5.14
    has no MADV_POPULATE_READ, so the pages are read ahead and touched instead."""
    from shard_worker.model.config import ModelConfig
    from shard_worker.model.loader import Checkpoint
    from shard_worker.model.offload import FileMaps
    from shard_worker.telemetry.accounting import proc_status

    entry = Checkpoint(big, ModelConfig.from_dir(big)).entry("model.layers.3.mlp.down_proj.weight")
    maps = FileMaps()
    maps._populate = populate_read
    try:
        view = maps.tensor(entry)
        nbytes = view.numel() * view.element_size()
        span = [(entry.path, entry.offset, entry.offset + nbytes)]
        before = proc_status()["RssFile"]
        maps.populate(span)
        mapped = proc_status()["RssFile"] - before
        maps.drop(span)
        left = proc_status()["RssFile"] - before
        folio = 2 * 2**20  # a page cache of 2 MiB folios maps whole ones at the span's two ends
        assert nbytes <= mapped <= nbytes + 2 * folio and left <= 2 * folio, (nbytes, mapped, left)
        assert view.dtype == torch.float32 and view.shape == (768, 2048)
        del view
    finally:
        maps.close()
