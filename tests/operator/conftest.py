"""Shared builders for the operator's tests: a tiny Llama profile, specs and plans."""

from __future__ import annotations

from typing import Any

import pytest

from shard_operator.api import parse_spec
from shard_operator.inventory import parse_devices
from shard_operator.planner import plan
from shard_operator.profile import profile_from_config

from tests.support.cluster import TINY_LLAMA


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
