"""The planner's entry point: the search, and when not one group fits, the explanation."""

from __future__ import annotations

from shard_contract.plan import Plan

from ..api import ShardedModelSpec
from .explain import capacity_needed, explain_infeasible, offload_note
from .inventory import Inventory
from .profile import ModelProfile
from .request import PlanError, PlannerOptions
from .search import NothingFits, search


def plan(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory,
         options: PlannerOptions | None = None) -> Plan:
    """The Plan of as many of `spec.replicas` groups as fit (at least one; zero when 0 are asked).

    When not one fits, the PlanError says why, and what would fit: every suggestion it makes was
    checked by planning again with it applied (`PlanError.suggestions`)."""
    options = options or PlannerOptions()
    try:
        return search(profile, spec, inventory, options)
    except NothingFits as nothing:
        request, pool, tps = nothing.request, nothing.inventory, nothing.tps
        short = capacity_needed(profile, request, pool, tps, options)
        note = offload_note(profile, spec, request, pool, tps, options)
        message, found = explain_infeasible(profile, spec, request, pool, tps, options, short, note)
        raise PlanError("InsufficientCapacity", message, short, found) from None
