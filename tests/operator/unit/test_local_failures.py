"""How `shardctl run`'s launcher reads its ranks' exits: a rank that exited EXIT_CONFIG failed for
good (its plan, checkpoint or environment is wrong) and is the one reported, even when a peer
failed beside it (a peer's failure may only be the group breaking); any other failure is one a
restart may fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from shard_contract.env import EXIT_CONFIG, EXIT_FAILED
from shard_operator.local.launcher import LocalGroup, RankProcess


class Exited:
    """A finished (or, with None, running) process as Popen shows it."""

    def __init__(self, code: int | None):
        self.returncode = code

    def poll(self) -> int | None:
        return self.returncode


def group_of(tmp_path: Path, *codes: int | None) -> LocalGroup:
    group = LocalGroup.__new__(LocalGroup)  # no plan needed: only its ranks are read
    group.ranks = []
    for rank, code in enumerate(codes):
        log = tmp_path / f"rank-{rank}.log"
        log.write_text(f"[shard_worker rank {rank}] exit {code}\n")
        group.ranks.append(RankProcess(rank, Exited(code), log))  # type: ignore[arg-type]
    return group


@pytest.mark.parametrize("codes, rank, permanent", [
    ((EXIT_FAILED, EXIT_CONFIG), 1, True),  # the peer's failure is reported, for good
    ((EXIT_CONFIG, EXIT_FAILED), 0, True),
    ((EXIT_FAILED, None), 0, False),
    ((-9, EXIT_FAILED), 0, False),  # killed: a restart may do
    ((None, EXIT_CONFIG), 1, True),
])
def test_a_rank_that_failed_for_good_is_the_one_reported(tmp_path, codes, rank, permanent):
    failure = group_of(tmp_path, *codes).failure()
    assert failure is not None and failure.permanent == permanent
    assert str(failure).startswith(f"rank {rank} ")
    assert f"[shard_worker rank {rank}] exit {codes[rank]}" in str(failure)  # its own log
    assert ("(a restart would fail the same way)" in str(failure)) == permanent


def test_no_failure_while_every_rank_runs_or_exited_cleanly(tmp_path):
    assert group_of(tmp_path, None, 0).failure() is None


def test_the_exit_statuses_are_distinct():
    assert EXIT_CONFIG not in (0, EXIT_FAILED) and 0 < EXIT_CONFIG < 128  # 128 + n: killed by signal n
