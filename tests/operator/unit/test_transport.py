"""The pod layout and the transport the planner prices each message by: tensor-parallel
collectives over NVLink (or shared memory) inside a pod, over the network between pods; pipeline
hops between pods of one node or between nodes. Tables, and the planner's decode step checked
against them."""

from __future__ import annotations

import pytest

from shard_operator.planning import PlannerOptions, plan
from shard_operator.planning.inventory import parse_devices
from shard_operator.planning.profile import profile_from_config
from shard_operator.planning.sizing import Shard, weight_bytes
from shard_operator.planning.step import StepOverhead
from shard_operator.planning.transport import PER_RANK, PER_TENSOR_GROUP, Transport, pod_layout
from tests.operator.unit.test_planner import LLAMA_8B, spec


@pytest.mark.parametrize("asked, kind, tp, layout", [
    ("auto", "gpu", 2, PER_TENSOR_GROUP),  # NVLink between the group's GPUs
    ("auto", "gpu", 8, PER_TENSOR_GROUP),
    ("auto", "gpu", 1, PER_RANK),  # one rank per stage: the same pods either way
    ("auto", "cpu", 2, PER_RANK),  # the dev cluster's simulated GPUs
    ("perRank", "gpu", 4, PER_RANK),
    ("perTensorGroup", "cpu", 2, PER_TENSOR_GROUP),
])
def test_pod_layout(asked, kind, tp, layout):
    assert pod_layout(asked, kind, tp) == layout


T = Transport()
S = StepOverhead()


@pytest.mark.parametrize("kind, layout, seconds", [
    ("gpu", PER_TENSOR_GROUP, T.collective_in_pod["gpu"]),
    ("gpu", PER_RANK, T.collective_across_pods["gpu"]),
    ("cpu", PER_TENSOR_GROUP, T.collective_in_pod["cpu"]),
    ("cpu", PER_RANK, T.collective_across_pods["cpu"]),
])
def test_collectives_are_priced_by_where_the_tensor_parallel_ranks_are(kind, layout, seconds):
    assert T.collective(kind, layout) == seconds


def test_in_a_pod_is_faster_than_across_pods_which_is_faster_than_across_nodes():
    for kind in ("gpu", "cpu"):
        assert T.collective_in_pod[kind] < T.collective_across_pods[kind]
        assert T.hop(kind, same_node=True) < T.hop(kind, same_node=False)


@pytest.mark.parametrize("devices, kind, layout, per_collective", [
    ("a:80GiB*2:H100", "gpu", "auto", T.collective_in_pod["gpu"]),  # auto: a pod per TP group on GPUs
    ("a:80GiB*2:H100", "gpu", "perTensorGroup", T.collective_in_pod["gpu"]),
    ("a:80GiB*2:H100", "gpu", "perRank", T.collective_across_pods["gpu"]),
    ("a:80GiB*2@0.015", "cpu", "auto", T.collective_across_pods["cpu"]),
    ("a:80GiB*2@0.015", "cpu", "perTensorGroup", T.collective_in_pod["cpu"]),
])
def test_the_decode_step_prices_tensor_parallel_collectives_by_the_pod_layout(devices, kind, layout, per_collective):
    profile = profile_from_config(LLAMA_8B)
    result = plan(profile, spec(parallelism={"tensor": 2, "pipeline": 1}, placement={"podLayout": layout}),
                  parse_devices(devices, kind=kind))
    bandwidth = parse_devices(devices, kind=kind).devices[0].speed * 1e12 * S.read_share[kind]
    stream = weight_bytes(profile, Shard(tp=2, layers=(0, 32), embeds=True, has_lm_head=True)) / bandwidth
    collectives = 2 * 32 + 2  # two all-reduces a layer, the embedding's and the LM head's gather
    launches = S.per_step[kind] + 32 * S.per_layer[kind]
    assert result.groups[0].critical_path_seconds == pytest.approx(stream + collectives * per_collective + launches)


@pytest.mark.parametrize("devices, hop", [
    ("a:80GiB*2:H100", T.hop_across_pods["gpu"]),  # two stages, two pods of one node
    ("a:80GiB:H100,b:80GiB:H100", T.hop_across_nodes["gpu"]),
])
def test_a_pipeline_hop_is_priced_by_whether_the_stages_share_a_node(devices, hop):
    profile = profile_from_config(LLAMA_8B)
    result = plan(profile, spec(parallelism={"tensor": 1, "pipeline": 2}), parse_devices(devices))
    group = result.groups[0]
    assert group.critical_path_seconds == pytest.approx(sum(s.seconds_per_token for s in group.stages) + hop)


def test_the_constants_are_settable():
    profile = profile_from_config(LLAMA_8B)
    asked = spec(parallelism={"tensor": 2, "pipeline": 1})
    devices = parse_devices("a:80GiB*2:H100")
    default = plan(profile, asked, devices).groups[0].critical_path_seconds
    slow = Transport(collective_in_pod={"gpu": 1e-3, "cpu": 1e-3})
    slower = plan(profile, asked, devices, PlannerOptions(transport=slow)).groups[0].critical_path_seconds
    assert slower - default == pytest.approx(66 * (1e-3 - T.collective_in_pod["gpu"]))


def test_the_operators_planner_options_change_only_what_they_name():
    from shard_contract.units import MiB
    from shard_operator.settings import Settings

    text = '{"runtime_overhead": {"gpu": 3221225472}, "transport": {"collective_across_pods": {"gpu": 0.0002}}}'
    options = Settings.from_env({"SHARD_OPERATOR_PLANNER_OPTIONS": text}).planner_options
    assert options.runtime_overhead == {"gpu": 3 * 2**30, "cpu": 64 * MiB}
    assert options.transport.collective_across_pods == {"gpu": 2e-4, "cpu": T.collective_across_pods["cpu"]}
    assert options.transport.hop_across_nodes == T.hop_across_nodes and options.tolerance == 0.10
    assert PlannerOptions.from_json("") == PlannerOptions()


@pytest.mark.parametrize("text, message", [
    ('{"transprot": {}}', "the options takes an object with keys runtime_overhead, step, tolerance, transport"),
    ('{"transport": {"collective_in_pod": {"tpu": 1}}}',
     "transport.collective_in_pod takes an object with keys cpu, gpu"),
    ('{"tolerance": "lots"}', "tolerance"),
    ('{"runtime_overhead": {"gpu": "2GiB"}}', "runtime_overhead"),
    ("{", "planner options"),
])
def test_bad_planner_options_are_named(text, message):
    """At the operator's start, with the variable that holds them."""
    from shard_operator.settings import Settings

    with pytest.raises(ValueError, match=r"^SHARD_OPERATOR_PLANNER_OPTIONS: planner options") as err:
        Settings.from_env({"SHARD_OPERATOR_PLANNER_OPTIONS": text})
    assert message in str(err.value)
