"""What a rank holds is what the plan predicted: on a checkpoint big enough (300 MB) for the
difference to show, each rank of a real `python -m shard_worker` group measures the growth of its
resident memory while loading weights and allocating its KV cache, and its peak."""

from __future__ import annotations

import pytest

from shard_contract.wire import GenerateRequest, GenerateTask
from shard_operator.local import run_generate
from tests.support.checkpoints import write_checkpoint

from .conftest import make_plan

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("big"), "llama", hidden_size=768, intermediate_size=2048,
                            num_layers=8, num_heads=12, num_kv_heads=4, vocab_size=16000,
                            max_position_embeddings=2048)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_resident_memory_matches_the_plan(big, tp, pp):
    plan = make_plan(big, tp, pp, max_len=1024, batch=4)  # a KV cache of ~34 MB per rank, too
    task = GenerateTask(requests=[GenerateRequest(prompt_ids=list(range(3, 40)), max_new_tokens=4)])
    result = run_generate(plan, big, task, timeout=300)
    assert len(result.ranks) == 2
    for r in result.ranks:
        predicted = r.predicted_bytes
        # the shapes are exactly the sizing's
        assert r.allocated_bytes == {"weights": predicted.weights, "kv_cache": predicted.kv_cache}
        # and the kernel agrees they are resident
        measured = r.resident_bytes.weights + r.resident_bytes.kv_cache
        expected = predicted.weights + predicted.kv_cache
        assert abs(measured - expected) <= 0.10 * expected, (r.rank, measured, expected)
        # nothing loaded twice or mapped whole: the peak above a bare torch stays near the plan
        assert 0 < r.resident_bytes.peak <= 1.15 * predicted.total, (r.rank, r.resident_bytes.peak, predicted)
