"""Shared-memory all-reduce of TP ranks on one machine (`shm.py`): ranks as forked processes, the
extension's one-call round (`_gemv.shm_all_reduce`) and the torch fallback compute the same bits,
on every rank, over enough rounds to reuse both slot sets; a rank that never comes is named."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch

from shard_worker import shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory collectives are x86-64 with /dev/shm only")


def tensors(rank: int) -> list[torch.Tensor]:
    """What rank `rank` sums, round after round: float32 and bfloat16, decode-sized and odd."""
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(1, 1, 2048, generator=g), torch.randn(3, 1, 100, generator=g).bfloat16(),
            torch.randn(7, generator=g), torch.randn(16384, generator=g).bfloat16(), torch.randn(5, generator=g) * 1e3]


def run_ranks(size: int, native: bool, timeout: float = 30.0, absent: int | None = None) -> list:
    """Each rank's results (or the error it raised), from forked processes."""
    path = shm.ShmGroup.create(size, "/dev/shm")
    children = []
    try:
        for rank in range(size):
            if rank == absent:
                continue
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the rank
                os.close(read)
                try:
                    if not native:
                        shm._gemv = None  # the torch path, as in a build without the extension
                    group = shm.ShmGroup(path, size, rank, timeout)
                    out = []
                    for t in tensors(rank):
                        group.all_reduce(t)
                        out.append(t)
                    result = [t.float().numpy().tobytes() + str(t.dtype).encode() for t in out]
                except Exception as err:  # reported to the test
                    result = f"{type(err).__name__}: {err}"
                with os.fdopen(write, "wb") as f:
                    f.write(pickle.dumps(result))
                os._exit(0)
            os.close(write)
            children.append((pid, read))
        results = []
        for pid, read in children:
            with os.fdopen(read, "rb") as f:
                results.append(pickle.loads(f.read()))
            os.waitpid(pid, 0)
        return results
    finally:
        os.unlink(path)


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_sum_in_rank_order_by_either_path(size):
    native, fallback = run_ranks(size, native=True), run_ranks(size, native=False)
    assert all(r == native[0] for r in native) and native == fallback  # same bits everywhere
    for i, expected_parts in enumerate(zip(*(tensors(r) for r in range(size)))):
        expected = expected_parts[0].float()
        for part in expected_parts[1:]:
            expected = expected + part.float()  # in rank order, in float32, rounded once
        expected = expected.to(expected_parts[0].dtype).float().numpy().tobytes()
        assert native[0][i][:len(expected)] == expected


@pytest.mark.parametrize("native", [True, False])
def test_a_rank_that_never_comes_is_named(native):
    start = time.monotonic()
    (result,) = run_ranks(2, native=native, timeout=0.5, absent=1)
    assert result.startswith("TimeoutError: TP rank 1 did not reach collective round 1")
    assert time.monotonic() - start < 20
