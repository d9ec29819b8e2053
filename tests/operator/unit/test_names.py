"""Generated object names cannot collide between models: model "a-metrics" is not given model "a"'s
metrics Service, nor a model named like another's group its Service, pods and key (issue 24, item 6).
A 409 on create is never taken as success for an object another model owns (test_kube.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shard_operator.objects.names import (
    base_name,
    endpoint_name,
    group_name,
    metrics_name,
    network_policy_name,
    plan_record_name,
    pod_name,
    profile_name,
)

REVISIONS = ("abc123", "000000", "123456")


def generated(model: str) -> set[str]:
    """Every name the operator gives an object of `model` (three replicas, revisions, four ranks)."""
    names = {endpoint_name(model), metrics_name(model), plan_record_name(model), profile_name(model),
             network_policy_name(model)}
    for replica in range(3):
        for revision in REVISIONS:
            names.add(group_name(model, replica, revision))
            names.update(pod_name(model, replica, revision, rank) for rank in range(4))
    return names


def test_a_model_named_like_another_s_objects_gets_names_of_its_own():
    a = generated("a")
    for other in sorted(a - {"a"}):  # "a-metrics", "a-plan", "a-0-abc123", "a-0-abc123-1", ...
        assert not generated(other) & a, other
    assert metrics_name("a") == "a-metrics" and endpoint_name("a-metrics") != "a-metrics"
    assert base_name("llama-3") == "llama-3" and base_name("llama") == "llama"  # plain names stay


NAME = st.text(st.sampled_from("ab0123-mcdefpl"), min_size=1, max_size=14).filter(
    lambda n: n[0].isalpha() and n[-1] != "-")


@settings(max_examples=300, deadline=None)
@given(a=NAME, b=NAME)
def test_two_models_never_share_a_generated_name(a, b):
    if a != b:
        assert not generated(a) & generated(b)
