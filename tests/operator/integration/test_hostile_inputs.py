"""The real operator against inputs written to break it: malicious checkpoints, a model path that
leaves its volume, and an API edge that raises what no reconcile expects. Each ends as a status
condition and one Warning Event, the loop lives on, and nothing is created."""

from __future__ import annotations

import re

from shard_operator.kube import Kube
from tests.support.cluster import gpu_node, sharded_model, write_model
from tests.support.malicious import ATTACKS, CORPUS, write_attack
from tests.support.operator import eventually


def degraded(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "Degraded")


async def test_every_malicious_checkpoint_fails_its_model_with_a_condition_and_an_event(world):
    await world.add_node(gpu_node("a"))
    models = {attack.name: write_attack(attack, world.tmp / "corpus" / attack.name) for attack in CORPUS}
    async with world.operator() as op:
        for name, model_dir in models.items():
            await world.create(sharded_model(name, model_dir))
        statuses = {name: await world.wait_phase(name, "Failed") for name in models}
        seen = op.reconciles
        await eventually(lambda: op.reconciles >= seen + len(models))  # still reconciling, quietly
        assert op.failures == 0  # every one an expected, named error
    for attack in CORPUS:
        condition = degraded(statuses[attack.name])
        assert condition["reason"] == "InvalidModel" and re.search(attack.error, condition["message"]), condition
        assert await world.events(attack.name) == [("Warning", "InvalidModel", condition["message"])]
        assert await world.objects("v1/pods", attack.name) == []


async def test_a_profiling_pod_refuses_a_malicious_checkpoint_by_name(world):
    """The operator cannot read the PVC: its profiling Pod reads the checkpoint, and fails with the error."""
    await world.add_node(gpu_node("a"))
    attack = ATTACKS["symlink-out-of-dir"]
    write_attack(attack, world.tmp / "pvc" / "attack")  # the kubelet mounts <tmp>/pvc at /models
    body = sharded_model("m1", world.tmp / "unused")
    body["spec"]["model"] = {"path": "attack/model", "volume": {"pvc": {"claimName": "weights"}}}
    async with world.operator() as op:
        await world.create(body)
        condition = degraded(await world.wait_phase("m1", "Failed"))
        assert op.failures == 0
    assert condition["reason"] == "InvalidModel" and "profiling pod m1-profile failed" in condition["message"]
    assert re.search(attack.error, condition["message"]), condition
    assert await world.events("m1") == [("Warning", "InvalidModel", condition["message"])]


async def test_a_model_path_that_leaves_its_volume_is_refused_without_saying_what_is_outside(world):
    await world.add_node(gpu_node("a"))
    volume = world.tmp / "volume"
    volume.mkdir()
    write_model(world.tmp / "outside" / "secret-model")  # a readable model, outside the volume
    (volume / "to-a-model").symlink_to(world.tmp / "outside" / "secret-model")
    (volume / "to-nothing").symlink_to(world.tmp / "outside" / "nothing")
    bodies = {name: sharded_model(name, volume / path) for name, path in
              [("dotdot", "x"), ("to-a-model", "to-a-model"), ("to-nothing", "to-nothing")]}
    bodies["dotdot"]["spec"]["model"]["path"] = "../../../../tmp/x"
    async with world.operator() as op:
        for body in bodies.values():
            await world.create(body)
        conditions = {name: degraded(await world.wait_phase(name, "Failed")) for name in bodies}
        assert op.failures == 0
    assert conditions["dotdot"]["message"] == \
        "spec.model.path: must stay inside the volume: no '..' segments (got '../../../../tmp/x')"
    for name in ("to-a-model", "to-nothing"):  # one answer whether the target exists or not
        assert (conditions[name]["reason"], conditions[name]["message"]) == \
            ("InvalidSpec", "spec.model.path must stay inside the volume")
    for name in bodies:
        assert await world.events(name) == [("Warning", "InvalidSpec", conditions[name]["message"])]
        assert await world.objects("v1/pods", name) == [] and await world.objects("v1/configmaps", name) == []


class FailingLists(Kube):
    """An API edge whose ConfigMap lists raise what no reconcile expects, until healed."""

    healed = False

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict]:
        if kind == "ConfigMap" and not self.healed:
            raise LookupError("injected: a list nobody can read")
        return super().list(kind, namespace, label_selector)


async def test_an_unexpected_exception_in_a_reconcile_is_a_condition_and_an_event(world):
    await world.add_node(gpu_node("a"))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator(kube_type=FailingLists) as op:
        await world.create(sharded_model("m1", model_dir))

        async def reported():
            status = await world.status("m1")
            return status if status.get("conditions") else None
        status = await eventually(reported)
        await eventually(lambda: op.failures >= 3)  # retried, the loop alive
        assert status["phase"] == "Pending"
        assert degraded(status) | {"lastTransitionTime": None} == {
            "type": "Degraded", "status": "True", "reason": "ReconcileError", "observedGeneration": 1,
            "message": "LookupError: injected: a list nobody can read", "lastTransitionTime": None}
        assert await world.events("m1") == [("Warning", "ReconcileError", degraded(status)["message"])]  # once

        op.kube.healed = True
        status = await world.wait_phase("m1", "Ready")
    assert (degraded(status)["status"], degraded(status)["reason"]) == ("False", "AsExpected")
