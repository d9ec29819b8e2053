"""The trust model's allow-lists (policy.py): worker images, hostPath directories and the API key's
Secret a ShardedModel may ask for; anything else is refused with the NotAllowed condition and no
pod is made (issue 24, item 7)."""

from __future__ import annotations

import dataclasses

import pytest

from shard_operator.policy import refusals, under
from shard_operator.settings import Settings
from tests.operator.conftest import make_spec
from tests.operator.unit.test_reconcile_table import SETTINGS, Sim
from tests.support.cluster import gpu_node

IMAGES = ("registry.example.com/shard-worker:*", "registry.example.com/shard-worker@sha256:*")
PATHS = ("/var/lib/shard-operator/models", "/data/models/")
SECRETS = ("*api-key*",)


def refused(image: str = "registry.example.com/shard-worker:0.1.0", **spec) -> list[str]:
    return refusals(make_spec(**spec), image, IMAGES, PATHS, SECRETS)


def host_path(path: str) -> dict:
    return {"model": {"path": "tiny", "volume": {"hostPath": {"path": path}}, "maxModelLen": 256}}


def test_what_the_lists_allow_passes():
    assert refused(**host_path("/var/lib/shard-operator/models")) == []
    assert refused(**host_path("/data/models/llama")) == []
    assert refused(image="registry.example.com/shard-worker@sha256:" + "a" * 64, **host_path("/data/models")) == []
    assert refused(worker={"apiKeySecret": {"name": "llama-api-key", "key": "k"}},
                   **host_path("/data/models")) == []


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"image": "evil.example.com/miner:1"}, "spec.worker.image 'evil.example.com/miner:1' is not among"),
    ({"image": "registry.example.com/shard-worker-evil:1"}, "is not among the images"),
    (host_path("/"), "hostPath '/' is not under a directory this operator allows"),
    (host_path("/var/lib/shard-operator/models-other"), "hostPath '/var/lib/shard-operator/models-other'"),
    (host_path("/etc"), "hostPath '/etc' is not under"),
    ({"model": {"path": "/root/.ssh", "volume": None, "maxModelLen": 256}}, "hostPath '/root/.ssh' is not under"),
    ({"worker": {"apiKeySecret": {"name": "db-password", "key": "k"}}, **host_path("/data/models")},
     "spec.worker.apiKeySecret 'db-password' is not a Secret this operator may mount"),
])
def test_what_the_lists_do_not_allow_is_named(kwargs, reason):
    reasons = refused(**{**host_path("/data/models"), **kwargs})
    assert len(reasons) == 1 and reason in reasons[0], reasons


@pytest.mark.parametrize(("path", "prefix", "inside"), [
    ("/models/a", "/models", True), ("/models", "/models", True), ("/models", "/models/", True),
    ("/models-x", "/models", False), ("/", "/models", False), ("/anything", "/", True),
])
def test_a_prefix_is_whole_path_components(path, prefix, inside):
    assert under(path, prefix) is inside


def test_the_lists_are_settings_read_from_the_environment():
    settings = Settings.from_env({"SHARD_OPERATOR_ALLOWED_IMAGES": "a/b:*, c/d@*",
                                  "SHARD_OPERATOR_ALLOWED_HOST_PATHS": "",
                                  "SHARD_OPERATOR_ALLOWED_API_KEY_SECRETS": "*api-key*"})
    assert settings.allowed_images == ("a/b:*", "c/d@*")
    assert settings.allowed_host_paths == ()  # the chart's empty list: no hostPath at all
    assert Settings().allowed_images == ("*",)  # unset: anything (the chart sets narrow defaults)


def test_a_refused_model_gets_the_not_allowed_condition_and_no_pod(tmp_path):
    settings = dataclasses.replace(SETTINGS, allowed_images=("registry.example.com/*",))
    sim = Sim(tmp_path, [gpu_node("a")], settings)
    sim.create()
    writes, events, _ = sim.reconcile()
    assert writes == ["status Failed"] and events == ["Warning NotAllowed"]
    condition = sim.condition("Degraded")
    assert condition["reason"] == "NotAllowed"
    assert "spec.worker.image 'example.com/shard-worker:test' is not among the images" in condition["message"]
    assert sim.pods() == []
