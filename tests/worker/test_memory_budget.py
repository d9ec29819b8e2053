"""SHARD_MEMORY_BUDGET: a simulated device's memory is a hard limit, as a GPU's is. A rank refuses a
plan that predicts more than the budget before it loads anything, and fails when what it measures
after loading exceeds the budget (a plan that under-predicted)."""

from __future__ import annotations

import pytest

from shard_contract.plan import PredictedBytes
from shard_contract.wire import GenerateRequest, GenerateTask
from shard_operator.local.launcher import LaunchError, run_generate
from shard_worker.rank.runtime import MemoryBudgetExceeded, PlanMismatch, check_budget

from .conftest import make_plan

TASK = GenerateTask(requests=[GenerateRequest(prompt_ids=[3, 4, 5], max_new_tokens=2)])


def test_check_budget():
    check_budget("x", 100, None)
    check_budget("x", 100, 100)
    with pytest.raises(MemoryBudgetExceeded, match=r"x 0.0 MiB exceed .* budget of 0.0 MiB"):
        check_budget("x", 101, 100)
    assert issubclass(MemoryBudgetExceeded, PlanMismatch)  # a known error: one line, no traceback


@pytest.fixture
def run(monkeypatch):
    def go(plan, model, budget):
        monkeypatch.setenv("SHARD_MEMORY_BUDGET", str(budget))  # the ranks inherit this environment
        return run_generate(plan, model, TASK, timeout=120, threads_per_rank=1)
    return go


@pytest.mark.slow
def test_a_rank_refuses_a_plan_over_its_budget_and_a_measurement_over_it(checkpoint, run):
    model = checkpoint("llama")
    plan = make_plan(model, 1, 1)
    predicted = plan.ranks[0].predicted_bytes.total
    assert run(plan, model, predicted).completions[0].token_ids  # exactly the budget: serves

    with pytest.raises(LaunchError,
                       match=r"the plan's predicted bytes of this rank .* exceed this device's memory budget"):
        run(plan, model, predicted - 1)

    # A plan that predicts (almost) nothing passes the first check; the measurement (after loading,
    # at the warm-up pass's peak) catches it.
    tiny = PredictedBytes(weights=1, kv_cache=1, activations=0, overhead=0)
    lying = plan.model_copy(update={"ranks": [plan.ranks[0].model_copy(update={"predicted_bytes": tiny})]})
    with pytest.raises(LaunchError, match=r"resident bytes at the warm-up's peak .* exceed"):
        run(lying, model, tiny.total)
