"""Shared-memory all-reduce of TP ranks on one machine (`shm.py`): ranks as forked processes, the
extension's one-call round (`_gemv.shm_all_reduce`) and the torch fallback compute the same bits,
on every rank, over enough rounds to reuse both slot sets; a rank that never comes is named."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from shard_worker.comm import shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory collectives are x86-64 with /dev/shm only")


def tensors(rank: int) -> list[torch.Tensor]:
    """What rank `rank` sums, round after round: float32 and bfloat16, decode-sized and odd."""
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(1, 1, 2048, generator=g), torch.randn(3, 1, 100, generator=g).bfloat16(),
            torch.randn(7, generator=g), torch.randn(16384, generator=g).bfloat16(), torch.randn(5, generator=g) * 1e3]


def rank_main(path: str, size: int, rank: int, native: bool, timeout: float, results) -> None:
    """One rank, in a process of its own: its results, or the error it raised, onto `results`."""
    try:
        if not native:
            shm._gemv = None  # the torch path, as in a build without the extension
        group = shm.ShmGroup(path, size, rank, timeout)
        out = []
        for t in tensors(rank):
            group.all_reduce(t)
            out.append(t)
        result = [t.float().numpy().tobytes() + str(t.dtype).encode() for t in out]
    except Exception as err:  # noqa: BLE001 -- reported to the test
        result = f"{type(err).__name__}: {err}"
    results.put((rank, result))


def run_ranks(size: int, native: bool, timeout: float = 30.0, absent: int | None = None) -> list:
    """Each rank's results (or the error it raised), in rank order. Ranks are spawned, not forked:
    a child forked from this process (whose torch has run OpenMP regions in earlier tests) can hang
    in libgomp's locks, and real ranks are fresh processes too."""
    path = shm.ShmGroup.create(size, "/dev/shm")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=rank_main, args=(path, size, rank, native, timeout, results))
             for rank in range(size) if rank != absent]
    try:
        for process in ranks:
            process.start()
        got = dict(results.get(timeout=timeout + 120) for _ in ranks)
        for process in ranks:
            process.join()
        return [got[rank] for rank in sorted(got)]
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
        os.unlink(path)


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_sum_in_rank_order_by_either_path(size):
    native, fallback = run_ranks(size, native=True), run_ranks(size, native=False)
    assert all(r == native[0] for r in native) and native == fallback  # same bits everywhere
    for i, expected_parts in enumerate(zip(*(tensors(r) for r in range(size)), strict=False)):
        expected = expected_parts[0].float()
        for part in expected_parts[1:]:
            expected = expected + part.float()  # in rank order, in float32, rounded once
        expected = expected.to(expected_parts[0].dtype).float().numpy().tobytes()
        assert native[0][i][:len(expected)] == expected


@pytest.mark.parametrize("native", [True, False])
def test_a_rank_that_never_comes_is_named(native):
    # (run_ranks waits for the answer with a generous bound: the ranks start torch first)
    (result,) = run_ranks(2, native=native, timeout=0.5, absent=1)
    assert result.startswith("TimeoutError: TP rank 1 did not reach collective round 1")
