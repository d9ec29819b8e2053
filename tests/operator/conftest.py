"""Shared builders for the operator's tests: a tiny Llama profile, specs, plans, a leader's report."""

from __future__ import annotations

from typing import Any

import pytest

from shard_contract.wire import ShardsResponse
from shard_operator.api import parse_spec
from shard_operator.planning import plan
from shard_operator.planning.inventory import parse_devices
from shard_operator.planning.profile import profile_from_config
from tests.support.cluster import TINY_LLAMA
from tests.support.shards import entry, rank_plan


def tiny_profile(**overrides: Any):
    return profile_from_config({**TINY_LLAMA, **overrides}, name="tiny")


def make_spec(**spec: Any):
    base: dict[str, Any] = {"model": {"path": "tiny", "volume": {"hostPath": {"path": "/models"}}, "maxModelLen": 256},
                            "parallelism": {"tensor": 2, "pipeline": 1}, "replicas": 1}
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return parse_spec(base)


def make_plan(devices: str = "a:24GiB*2,b:24GiB*2", **spec: Any):
    return plan(tiny_profile(), make_spec(**spec), parse_devices(devices))


@pytest.fixture
def profile():
    return tiny_profile()


RESIDENT = 100 * 2**20  # what the fake leaders report per rank, plus rank * 1 MiB


def leader_report() -> ShardsResponse:
    """What a fake leader's GET /v1/shards answers: RESIDENT + rank MiB for each of 8 ranks, which
    spent 3 s computing and 1 s communicating; the leader's last batch took 20 ms a decode step."""
    return ShardsResponse(model="m", replica=0, ready=True, ranks=[
        entry(rank_plan(r), RESIDENT + r * 2**20, compute_seconds=3.0, comm_seconds=1.0, idle_seconds=0.0,
              **({"last_generate": {"decode_seconds": 0.5, "decode_steps": 25}} if r == 0 else {}))
        for r in range(8)])
