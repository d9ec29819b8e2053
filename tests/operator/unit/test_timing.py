"""The loop's timing rules as pure functions of a clock: the settle window, the leader poll, the
next run."""

from __future__ import annotations

import math

import pytest

from shard_operator.reconcile.timing import Pool, poll_in, requeue_after, retry_after, settle

WINDOW = 30.0


def test_a_new_pool_waits_the_window_then_is_reconsidered_once():
    first = settle(Pool(), "p1", generation=1, now=100.0, window=WINDOW)
    assert (first.settled, first.reconsider, first.wake_in) == (False, False, pytest.approx(30.01))
    waiting = settle(first.considered(), "p1", generation=1, now=120.0, window=WINDOW)
    assert (waiting.settled, waiting.wake_in) == (False, pytest.approx(10.01))
    settled = settle(waiting.considered(), "p1", generation=1, now=130.0, window=WINDOW)
    assert (settled.settled, settled.reconsider, settled.wake_in) == (True, True, None)
    again = settle(settled.considered(), "p1", generation=1, now=200.0, window=WINDOW)
    assert (again.settled, again.reconsider) == (True, False)  # once per settled pool


def test_a_pool_that_changes_again_restarts_the_window():
    pool = settle(Pool(), "p1", 1, 100.0, WINDOW).considered()
    pool = settle(pool, "p2", 1, 125.0, WINDOW).considered()  # flapping: the window starts over
    back = settle(pool, "p1", 1, 140.0, WINDOW)
    assert (back.settled, back.wake_in) == (False, pytest.approx(30.01))


def test_a_pool_that_changed_with_the_spec_acts_at_once():
    pool = settle(Pool(), "p1", 1, 100.0, WINDOW).considered()
    edited = settle(pool, "p2", 2, 101.0, WINDOW)  # a new nodeSelector chose another pool
    assert edited.settled and edited.pool.since == -math.inf
    same_spec = settle(pool, "p2", 1, 101.0, WINDOW)  # the nodes changed by themselves
    assert not same_spec.settled


def test_reconsidering_is_remembered_only_once_a_plan_was_chosen():
    settled = settle(Pool("p1", since=0.0, generation=1), "p1", 1, 100.0, WINDOW)
    assert settled.reconsider and settled.pool.reconsidered == ""  # a PlanError keeps it to do
    assert settled.considered().reconsidered == "p1"


@pytest.mark.parametrize("last,now,period,due_in", [
    (-math.inf, 0.0, 20.0, 0.0),  # never polled: now
    (100.0, 105.0, 20.0, 15.0),
    (100.0, 120.0, 20.0, 0.0),
    (100.0, 130.0, 20.0, 0.0),
    (100.0, 105.0, 0.0, None),  # polling off
])
def test_poll_in(last, now, period, due_in):
    assert poll_in(last, now, period) == due_in


def test_requeue_after_is_the_earliest_wait_at_most_the_resync():
    assert requeue_after(60.0) == 60.0
    assert requeue_after(60.0, None, 20.0, 5.0) == 5.0
    assert requeue_after(10.0, 30.01, None) == 10.0


def test_a_failed_reconcile_runs_again_soon_and_no_later_than_planned():
    assert retry_after(60.0, None) == 5.0
    assert retry_after(0.5, None) == 0.5  # a short resync (tests) is sooner still
    assert retry_after(60.0, 0.31) == 0.31  # the settle window it was waiting for
