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
from shard_operator.local import run_generate
from tests.support.checkpoints import write_checkpoint
from tests.support.offload import streaming_plan

from .pool import GenerateJob
from .test_parallel import PROMPT, assert_matches_hf, run_greedy

pytestmark = pytest.mark.slow

# 24 layers: 25% streamed is 6 layers on one stage, 3 on each of two.
SHAPE = dict(hidden_size=64, intermediate_size=128, num_layers=24, num_heads=4, num_kv_heads=2, vocab_size=250,
             max_position_embeddings=256)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("deep"), "llama", seed=7, **SHAPE)


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
        for report in results[0]["reports"]:
            off = plan.rank_plan(0, report["rank"]).offload
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
            assert report["allocated_bytes"]["staging"] == report["predicted_bytes"]["staging"] == 0
            assert report["allocated_bytes"]["weights"] == report["predicted_bytes"]["weights"]


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_every_borrow_gets_its_own_layer_whatever_the_order(deep, prefetch):
    """The prefetcher loads ahead in forward order; a forward pass that ends early (an error
    mid-stage) makes the next one ask out of that order, and it still gets the right weights."""
    from shard_worker.accounting import Accounting
    from shard_worker.config import ModelConfig
    from shard_worker.dist import Comm, Topology
    from shard_worker.loader import load_stage
    from shard_worker.model import Layout, Stage
    from shard_worker.offload import Streamer

    plan = streaming_plan(deep, 1, 1, 1.0, prefetch=prefetch)
    off = plan.ranks[0].offload
    config = ModelConfig.from_dir(deep)
    layout = Layout(config, tp=1, tp_rank=0, layers=(0, config.num_layers), embeds=True, has_lm_head=True)
    acct = Accounting()
    comm = Comm(Topology(rank=0, tp=1, pp=1), acct)
    whole = Stage(layout, comm, torch.float32, torch.device("cpu"))
    load_stage(whole, deep)
    stage = Stage(layout, comm, torch.float32, torch.device("cpu"), streamed=off.layers)
    load_stage(stage, deep)
    streamer = stage.streamer = Streamer(stage, off, deep, acct).start()
    try:
        order = [0, 1, 2, 0, 1, 2, 3, 7, 8, 23, 0, 5, 5, 6, 7, 22, 23, 0, 1]
        for j in order:
            layer = stage.layers[j]
            with streamer.lend(layer):
                for name, projection in layer.projections().items():
                    assert torch.equal(_matrix(projection), whole.tensors()[f"layers.{j}.{name}.weight"]), (j, name)
            assert layer.attn.qkv.weight.numel() == 0  # given back
        assert acct.counters.streamed_bytes >= len(order) * off.streamed_bytes // len(off.layers)
    finally:
        streamer.close()


def _matrix(projection) -> torch.Tensor:
    """A projection's weight as one matrix (a streamed one may be row blocks of the mapped file)."""
    weights = projection.weights()
    return torch.cat(weights) if isinstance(weights, tuple) else weights


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("big-offload"), "llama", hidden_size=768,
                            intermediate_size=2048, num_layers=8, num_heads=12, num_kv_heads=4, vocab_size=16000,
                            max_position_embeddings=2048)


def test_a_streaming_rank_holds_its_plan_not_the_model(big):
    """Streaming every layer at TP=2, each rank of a real `python -m shard_worker` group holds its
    resident plan while it serves: its peak resident set above a bare torch stays within 1.15x
    of it, far below its share of the model (the page cache holds the streamed layers)."""
    plan = streaming_plan(big, 2, 1, 1.0, max_len=512, batch=2)
    task = GenerateTask(requests=[GenerateRequest(prompt_ids=list(range(3, 40)), max_new_tokens=8)])
    result = run_generate(plan, big, task, timeout=300)
    assert len(result.ranks) == 2
    for r in result.ranks:
        predicted, off = r.predicted_bytes, plan.rank_plan(0, r.rank).offload
        assert r.allocated_bytes == {"weights": predicted.weights, "kv_cache": predicted.kv_cache,
                                     "staging": predicted.staging}
        assert predicted.weights + off.streamed_bytes > 2 * (predicted.weights + predicted.staging)
        assert 0 < r.resident_bytes.peak <= 1.15 * predicted.total, (r.rank, r.resident_bytes.peak, predicted)
        assert r.streamed_bytes >= 8 * off.streamed_bytes
