"""A GPU rank's pinned host memory: one arena of exactly the bytes asked for (torch's pin_memory
would round each tensor up to a power of two), registered with CUDA once, carved into aligned
views, unregistered and unmapped by `close`; and sized as the plan counts it. No GPU here: a fake
CUDA runtime records what would be registered."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from shard_worker.model.pinned import ALIGN, PinnedArena, aligned, arena_bytes


class FakeCudart:
    """torch.cuda.cudart() as far as the arena uses it; `fail` makes registering return that error."""

    def __init__(self, fail: int = 0) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        return self.fail

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0

    def cudaGetErrorString(self, error: int) -> str:
        return f"error string {error}"


def test_views_are_aligned_disjoint_and_fill_the_registered_range():
    shapes = [(3, 5), (7,), (64, 64), (1,)]
    nbytes = arena_bytes(shapes, torch.float32)
    assert nbytes == aligned(60) + aligned(28) + 64 * 64 * 4 + aligned(4) == 3 * ALIGN + 16384
    cudart = FakeCudart()
    arena = PinnedArena(nbytes, cudart=cudart)
    views = [arena.take(s, torch.float32) for s in shapes]
    (what, base, size, flags), = cudart.calls
    assert (what, size, flags) == ("register", nbytes, 0) and base % 4096 == 0  # a page-aligned map
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * 4) for v in views)
    assert all(a % ALIGN == 0 for a, _ in spans)
    assert all(b <= c for (_, b), (c, _) in pairwise(spans))  # disjoint
    assert spans[0][0] == base and spans[-1][1] <= base + nbytes
    for i, v in enumerate(views):
        v.fill_(i)
    assert [float(v.flatten()[-1]) for v in views] == [0.0, 1.0, 2.0, 3.0]  # nothing overlaps
    with pytest.raises(ValueError, match="has 0 left"):
        arena.take((1,), torch.float32)
    del views, v
    arena.close()
    arena.close()  # once is enough
    assert cudart.calls[1:] == [("unregister", base)]


def test_unpinned_and_empty_arenas_never_call_cuda():
    arena = PinnedArena(4096, pin=False, cudart=FakeCudart())
    assert arena._cudart is None
    arena.take((1024,), torch.float32).fill_(1.0)
    arena.close()
    empty = PinnedArena(0)  # no CUDA runtime asked for (this machine has none)
    empty.close()


def test_a_refused_registration_says_so_and_nothing_is_unregistered():
    cudart = FakeCudart(fail=2)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 8192 bytes .* CUDA error 2 \(error string 2\)"):
        PinnedArena(8192, cudart=cudart)
    assert [c[0] for c in cudart.calls] == ["register"]


@pytest.mark.parametrize("host_memory, tier", [(None, "host"), ("1MiB", "host+files")])
def test_a_gpu_rank_pins_what_its_plan_counts(tmp_path, host_memory, tier):
    """The arena of a streaming GPU rank holds its host-tier layers and, when it reads files, a
    buffer per slot: the plan's host_bytes less the page cache it counts for the files."""
    from shard_worker.comm.dist import Comm, Topology
    from shard_worker.model.config import ModelConfig
    from shard_worker.model.model import Stage
    from shard_worker.model.offload import pinned_layers
    from shard_worker.model.slices import Layout
    from shard_worker.telemetry.accounting import Accounting
    from tests.support.checkpoints import write_checkpoint
    from tests.support.offload import streaming_plan

    model_dir = write_checkpoint(tmp_path, "llama", seed=3, hidden_size=64, intermediate_size=128, num_layers=12,
                                 num_heads=4, num_kv_heads=2, vocab_size=250, max_position_embeddings=256)
    off = streaming_plan(model_dir, 1, 1, 1.0, kind="gpu", host_memory=host_memory).ranks[0].offload
    assert off.tier == tier
    config = ModelConfig.from_dir(model_dir)
    layout = Layout(config, tp=1, tp_rank=0, layers=(0, config.num_layers), embeds=True, has_lm_head=True)
    acct = Accounting()
    stage = Stage(layout, Comm(Topology(rank=0, tp=1, pp=1), acct), torch.float32, torch.device("cpu"),
                  streamed=off.layers)
    shapes = [p.shape for p in stage.layers[off.layers[0]].projections().values()]
    layer = arena_bytes(shapes, torch.float32)
    assert layer == off.streamed_bytes // len(off.layers)  # no padding at these sizes
    assert pinned_layers(off) * layer == off.host_bytes - off.read_bytes
    if off.file_layers:
        assert pinned_layers(off) == len(off.layers) - len(off.file_layers) + off.prefetch
