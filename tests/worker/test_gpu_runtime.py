"""What a rank decides from its GPU, as pure functions (no GPU here): the dtype the group runs on
GPUs without native bfloat16, and what it measures on a GPU (device memory in use since CUDA
started, so NCCL's buffers and cuBLAS workspaces count, not only torch's allocator)."""

from __future__ import annotations

import pytest
import torch

from shard_worker.rank.runtime import agreed_dtype, resident_bytes
from shard_worker.telemetry.accounting import MemorySample

GiB = 2**30


class Votes:
    """`Comm.all_true` over a group whose other ranks answer `others`."""

    def __init__(self, others: bool):
        self.others, self.asked = others, []

    def all_true(self, flag: bool) -> bool:
        self.asked.append(flag)
        return flag and self.others


@pytest.mark.parametrize("planned, capability, others, dtype, why", [
    ("bfloat16", (9, 0), True, torch.bfloat16, ""),  # H100
    ("bfloat16", (8, 0), True, torch.bfloat16, ""),  # A100
    ("bfloat16", (7, 5), True, torch.float16, "this GPU (compute capability 7.5)"),  # T4
    ("bfloat16", (7, 0), True, torch.float16, "this GPU (compute capability 7.0)"),  # V100
    ("bfloat16", (8, 6), False, torch.float16, "another rank's GPU"),  # the whole group agrees
    ("bfloat16", None, True, torch.bfloat16, ""),  # a CPU
    ("float16", (7, 5), True, torch.float16, ""),
    ("float32", (7, 0), False, torch.float32, ""),  # nothing to agree on
])
def test_bfloat16_becomes_float16_on_every_rank_where_a_gpu_lacks_it(planned, capability, others, dtype, why):
    votes = Votes(others)
    got, reason = agreed_dtype(planned, capability, votes)
    assert got == dtype and why in reason and bool(reason) == bool(why)
    assert bool(votes.asked) == (planned == "bfloat16")  # every rank asks, or none does
    if reason:
        assert "the group runs float16" in reason


def sample(allocated: int = 0, reserved: int = 0, used: int = 0, anon: int = 0) -> MemorySample:
    return MemorySample(rss=anon, rss_anon=anon, peak_rss=anon, cuda_allocated=allocated, cuda_reserved=reserved,
                        cuda_used=used)


def test_a_gpu_ranks_total_is_device_memory_since_cuda_started():
    baseline = sample(anon=400 * 2**20)  # the bare process, before CUDA
    started = sample(used=int(0.5 * GiB))  # the context CUDA made as it started (and other processes)
    before = sample(allocated=0, reserved=0, used=int(1.2 * GiB))  # NCCL's buffers after the rendezvous
    # weights and KV cache: what the caching allocator reserved for them (a little above allocated)
    loaded = sample(allocated=10 * GiB, reserved=10 * GiB + 2**20, used=int(11.4 * GiB))
    cached = sample(allocated=12 * GiB, reserved=12 * GiB + 3 * 2**20, used=int(13.6 * GiB))
    r = resident_bytes(baseline, started, before, loaded, cached, cached, on_cuda=True)  # no staging
    assert (r.weights, r.kv_cache) == (10 * GiB + 2**20, 2 * GiB + 2 * 2**20)
    assert r.total == int(13.6 * GiB) - int(0.5 * GiB)  # 1.1 GiB more than torch's allocations


def test_a_cpu_ranks_total_is_anonymous_memory_above_the_bare_process():
    baseline = sample(anon=400)
    r = resident_bytes(baseline, baseline, sample(anon=500), sample(anon=1500), sample(anon=1700), sample(anon=1760),
                       on_cuda=False)
    assert (r.weights, r.kv_cache, r.staging, r.total) == (1000, 200, 60, 1360)
