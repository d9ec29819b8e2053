"""Conformance of the emulated API server's checks of custom resources (shard_devcluster/validation.py,
emulator.py), over raw HTTP as kubectl and the clients meet them; each test says what kube-apiserver
v1.36 does. The ShardedModel CRD is the one `make crd` generates; a small CRD of this file's own
covers the rule features the ShardedModel does not use (oldSelf, messageExpression, reason,
fieldPath)."""

from __future__ import annotations

import aiohttp
import pytest

from shard_devcluster.apirules import ApiError
from shard_devcluster.apiserver import SM, serve

SMS = "/apis/sharding.dev/v1alpha1/namespaces/default/shardedmodels"
WIDGETS = "/apis/test.dev/v1/namespaces/default/widgets"
MERGE = {"Content-Type": "application/merge-patch+json"}
JSON_PATCH = {"Content-Type": "application/json-patch+json"}
VOLUME = {"hostPath": {"path": "/models"}}


def sm(name="m", **spec):
    return {"apiVersion": "sharding.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": name},
            "spec": {"model": {"path": "tiny", "volume": VOLUME}, **spec}}


def widget_crd(rules: dict) -> dict:
    """A CRD whose spec.size and spec.name carry `rules` ({"size": [...], "name": [...], "spec": [...]})."""
    spec = {"type": "object", "x-kubernetes-validations": rules.get("spec", []), "properties": {
        "size": {"type": "integer", "x-kubernetes-validations": rules.get("size", [])},
        "name": {"type": "string", "x-kubernetes-validations": rules.get("name", [])},
        "limits": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}}}}
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "widgets.test.dev"},
            "spec": {"group": "test.dev", "scope": "Namespaced",
                     "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
                     "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                                   "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                                       "spec": spec, "status": {"type": "object"}}}}}]}}


class Api:
    def __init__(self, session: aiohttp.ClientSession):
        self.s = session

    async def __call__(self, method, url, **kw):
        async with self.s.request(method, url, **kw) as r:
            return r.status, await r.json(), r.headers.getall("Warning", [])


@pytest.fixture
async def cluster():
    async with serve(control_plane=False) as (emu, url):
        async with aiohttp.ClientSession(base_url=url) as session:
            yield emu, Api(session)


def causes(body: dict) -> dict[str, tuple[str, str]]:
    return {c["field"]: (c["reason"], c["message"]) for c in body["details"]["causes"]}


async def test_an_invalid_spec_is_422_with_a_cause_per_field_and_nothing_is_stored(cluster):
    """kube-apiserver validates a custom resource against its CRD's schema and CEL rules before it
    stores it: 422 Invalid, a message naming every field, and `details.causes` with one entry per
    field (reason FieldValue*, the field's path, the message without it)."""
    emu, api = cluster
    st, b, _ = await api("POST", SMS, json=sm(parallelism={"tensor": 0}, replicas=-1))
    assert (st, b["reason"], b["details"]["kind"], b["details"]["group"]) == \
        (422, "Invalid", "ShardedModel", "sharding.dev")
    assert causes(b) == {
        "spec.replicas": ("FieldValueInvalid",
                          "Invalid value: -1: spec.replicas in body should be greater than or equal to 0"),
        "spec.parallelism.tensor": ("FieldValueInvalid", 'Invalid value: 0: must be a positive integer or "auto"')}
    assert b["message"].startswith('ShardedModel.sharding.dev "m" is invalid: [spec.replicas: Invalid value: -1: ')
    assert await emu.k8s_get(SM, "default", "m") is None


@pytest.mark.parametrize("spec,field,reason,message", [
    # type: kube-openapi's "must be of type", reported as FieldValueTypeInvalid
    (dict(replicas="two"), "spec.replicas", "FieldValueTypeInvalid",
     'Invalid value: "string": spec.replicas in body must be of type integer: "string"'),
    # enum: FieldValueNotSupported with the supported values quoted
    (dict(model={"path": "tiny", "dtype": "float8"}), "spec.model.dtype", "FieldValueNotSupported",
     'Unsupported value: "float8": supported values: "auto", "float32", "bfloat16", "float16"'),
    # pattern: the path may not leave its volume
    (dict(model={"path": "../etc", "volume": VOLUME}), "spec.model.path", "FieldValueInvalid",
     'Invalid value: "../etc": spec.model.path in body should match '),
    # required
    (dict(model={"volume": VOLUME}), "spec.model.path", "FieldValueRequired", "Required value"),
    # minLength, in characters
    (dict(model={"path": "tiny", "volume": {"pvc": {"claimName": ""}}}), "spec.model.volume.pvc.claimName",
     "FieldValueInvalid", 'Invalid value: "": spec.model.volume.pvc.claimName in body should be at least 1 chars long'),
    # maximum
    (dict(worker={"port": 70000}), "spec.worker.port", "FieldValueInvalid",
     "Invalid value: 70000: spec.worker.port in body should be less than or equal to 65535"),
    # items of a list, by index
    (dict(parallelism={"layerPartition": [2, 0]}), "spec.parallelism.layerPartition[1]", "FieldValueInvalid",
     "Invalid value: 0: spec.parallelism.layerPartition[1] in body should be greater than or equal to 1"),
    # the CRD's CEL rule on the volume (x-kubernetes-validations): exactly one source
    (dict(model={"path": "tiny", "volume": {"hostPath": {"path": "/m"}, "pvc": {"claimName": "c"}}}),
     "spec.model.volume", "FieldValueInvalid", "Invalid value: give exactly one of pvc, hostPath or image"),
    (dict(model={"path": "tiny", "volume": {}}), "spec.model.volume", "FieldValueInvalid",
     "Invalid value: give exactly one of pvc, hostPath or image"),
    # spec.serving: a fraction's bounds, and the CEL rule that allows one of the two sizes
    (dict(serving={"kvCacheMemoryFraction": 1.5}), "spec.serving.kvCacheMemoryFraction", "FieldValueInvalid",
     "Invalid value: 1.5: spec.serving.kvCacheMemoryFraction in body should be less than or equal to 1"),
    (dict(serving={"kvCacheMemoryFraction": 0.5, "kvCacheMemory": "1Gi"}), "spec.serving", "FieldValueInvalid",
     "Invalid value: give at most one of kvCacheMemoryFraction and kvCacheMemory"),
    # the int-or-"auto" rule, on a string
    (dict(parallelism={"pipeline": "max"}), "spec.parallelism.pipeline", "FieldValueInvalid",
     'Invalid value: "max": must be a positive integer or "auto"'),
    # the worker pods' labels: a CEL rule over the map's keys, a pattern on its values, a size bound
    (dict(worker={"podLabels": {"sharding.dev/group": "9"}}), "spec.worker.podLabels", "FieldValueInvalid",
     "Invalid value: sharding.dev/ keys and app.kubernetes.io/managed-by are the operator's"),
    (dict(worker={"podLabels": {"team": "ml platform"}}), "spec.worker.podLabels.team", "FieldValueInvalid",
     'Invalid value: "ml platform": spec.worker.podLabels.team in body should match '),
    (dict(worker={"podAnnotations": {f"k{i}": "v" for i in range(65)}}), "spec.worker.podAnnotations",
     "FieldValueTooMany", "Too many: 65: must have at most 64 items"),
    (dict(worker={"capabilities": ["SYS_ADMIN"]}), "spec.worker.capabilities[0]", "FieldValueNotSupported",
     'Unsupported value: "SYS_ADMIN": supported values: "IPC_LOCK"'),
])
async def test_schema_types_bounds_patterns_required_and_cel_rules(cluster, spec, field, reason, message):
    """Each of the OpenAPI v3 validations a structural schema may carry, and the CRD's CEL rules,
    as kube-apiserver words them (kube-openapi's messages, apimachinery's field errors)."""
    _, api = cluster
    body = sm(**spec)
    body["spec"].update(spec)
    st, b, _ = await api("POST", SMS, json=body)
    assert st == 422 and causes(b)[field][0] == reason and causes(b)[field][1].startswith(message), b


async def test_a_wrong_type_skips_the_cel_rules_and_says_so(cluster):
    """A type, enum, required or size error leaves the object in a shape its rules were not written
    for: the server runs none of them and adds a cause saying some rules were not checked."""
    _, api = cluster
    st, b, _ = await api("POST", SMS, json=sm(replicas="two", parallelism={"tensor": 0}))
    assert st == 422 and set(causes(b)) == {"spec.replicas", "<nil>"}
    assert "some validation rules were not checked because the object was invalid" in causes(b)["<nil>"][1]


async def test_field_validation_strict_warn_and_ignore(cluster):
    """fieldValidation=Strict (kubectl's default) refuses unknown fields with 400 BadRequest naming
    each ("strict decoding error: unknown field"); Warn (the server's default) prunes them and says
    so in a Warning header each; Ignore prunes them quietly. Defaults apply in every case."""
    _, api = cluster
    body = sm(replica=2)
    body["spec"]["model"]["sharding"] = "yes"
    st, b, _ = await api("POST", SMS, json=body, params={"fieldValidation": "Strict"})
    assert (st, b["reason"]) == (400, "BadRequest")
    assert b["message"] == ('ShardedModel in version "v1alpha1" cannot be handled as a ShardedModel: strict decoding '
                            'error: unknown field "spec.model.sharding", unknown field "spec.replica"')
    st, b, warnings = await api("POST", SMS, json=body)
    assert st == 201 and warnings == ['299 - "unknown field \\"spec.model.sharding\\""',
                                      '299 - "unknown field \\"spec.replica\\""']
    assert "replica" not in b["spec"] and b["spec"]["replicas"] == 1
    st, b, warnings = await api("POST", SMS, json=sm("quiet", replica=2), params={"fieldValidation": "Ignore"})
    assert (st, warnings) == (201, [])
    st, b, _ = await api("POST", SMS, json=sm("other"), params={"fieldValidation": "Loose"})
    assert st == 400


async def test_updates_and_patches_are_validated_and_unchanged_values_ratchet(cluster):
    """Every write is validated: a merge patch, a JSON patch and a PUT that make the object invalid
    are 422 and change nothing. Validation ratcheting (GA in v1.33): an object stored before its
    schema tightened may still be updated where its invalid values stay as they are; changing one
    to another invalid value is refused."""
    emu, api = cluster
    st, created, _ = await api("POST", SMS, json=sm())
    assert st == 201
    st, b, _ = await api("PATCH", f"{SMS}/m", json={"spec": {"parallelism": {"tensor": 0}}}, headers=MERGE)
    assert st == 422 and "spec.parallelism.tensor" in causes(b)
    st, b, _ = await api("PATCH", f"{SMS}/m", json=[{"op": "replace", "path": "/spec/replicas", "value": -3}],
                         headers=JSON_PATCH)
    assert st == 422 and "spec.replicas" in causes(b)
    st, b, _ = await api("PUT", f"{SMS}/m", json={**created, "spec": {**created["spec"], "replicas": -2}})
    assert st == 422
    unchanged = await emu.k8s_get(SM, "default", "m")
    assert unchanged["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]

    await emu.k8s_create(SM, "default", sm("old", replicas=-1))  # stored as it was (the in-process API)
    st, b, _ = await api("PATCH", f"{SMS}/old", json={"metadata": {"labels": {"team": "a"}}, "spec": {"parallelism": {
        "tensor": 2}}}, headers=MERGE)
    assert st == 200 and b["spec"]["replicas"] == -1
    st, b, _ = await api("PATCH", f"{SMS}/old", json={"spec": {"replicas": -2}}, headers=MERGE)
    assert st == 422 and set(causes(b)) == {"spec.replicas"}


async def test_the_status_subresource_checks_the_status_only_and_scale_the_replicas(cluster):
    """A write to /status is validated in its status (the spec, not written there, is not looked
    at); the scale subresource's replicas land in spec.replicas and meet its minimum."""
    emu, api = cluster
    await emu.k8s_create(SM, "default", sm("old", replicas=-1))
    st, b, _ = await api("PATCH", f"{SMS}/old/status", json={"status": {"phase": "Ready"}}, headers=MERGE)
    assert st == 200 and b["status"]["phase"] == "Ready"
    st, b, _ = await api("PATCH", f"{SMS}/old/status", json={"status": {"phase": "Sleeping"}}, headers=MERGE)
    assert st == 422 and set(causes(b)) == {"status.phase", "<nil>"}
    await api("POST", SMS, json=sm())
    st, b, _ = await api("PATCH", f"{SMS}/m/scale", json={"spec": {"replicas": -1}}, headers=MERGE)
    assert st == 422 and "spec.replicas" in causes(b)
    st, b, _ = await api("PATCH", f"{SMS}/m/scale", json={"spec": {"replicas": 3}}, headers=MERGE)
    assert st == 200 and b["spec"]["replicas"] == 3


async def test_rules_with_old_self_message_expressions_reasons_and_field_paths(cluster):
    """x-kubernetes-validations as kube-apiserver evaluates them: `self` is the node's value; a rule
    naming `oldSelf` (a transition rule) runs on updates only, and is never ratcheted; a failing
    rule says its `messageExpression`'s value, else its `message`, else "failed rule: RULE"; its
    `reason` picks the cause's reason and `fieldPath` the field; rules of additionalProperties
    values name the key in brackets."""
    emu, api = cluster
    emu.add_crd(widget_crd({
        "size": [{"rule": "self >= oldSelf", "message": "may not shrink"}],
        "name": [{"rule": "self != 'admin'", "messageExpression": "'the name ' + self + ' is reserved'"},
                 {"rule": "self.size() <= 8"}],
        "spec": [{"rule": "!has(self.name) || self.name != 'root'", "fieldPath": ".name",
                  "reason": "FieldValueForbidden", "message": "root is not a widget"}]}))
    widget = {"apiVersion": "test.dev/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {"size": 5}}
    st, _, _ = await api("POST", WIDGETS, json=widget)
    assert st == 201  # no old value: the transition rule does not run
    st, b, _ = await api("PATCH", f"{WIDGETS}/w", json={"spec": {"size": 3}}, headers=MERGE)
    assert st == 422 and causes(b) == {"spec.size": ("FieldValueInvalid", "Invalid value: 3: may not shrink")}
    st, b, _ = await api("PATCH", f"{WIDGETS}/w", json={"spec": {"size": 6, "name": "admin"}}, headers=MERGE)
    assert causes(b) == {"spec.name": ("FieldValueInvalid", 'Invalid value: "admin": the name admin is reserved')}
    st, b, _ = await api("PATCH", f"{WIDGETS}/w", json={"spec": {"name": "a-long-name"}}, headers=MERGE)
    assert causes(b) == {"spec.name": ("FieldValueInvalid",
                                       'Invalid value: "a-long-name": failed rule: self.size() <= 8')}
    st, b, _ = await api("PATCH", f"{WIDGETS}/w", json={"spec": {"name": "root"}}, headers=MERGE)
    assert causes(b) == {"spec.name": ("FieldValueForbidden", "Forbidden: root is not a widget")}
    st, b, _ = await api("PATCH", f"{WIDGETS}/w", json={"spec": {"limits": {"gpu": -1}}}, headers=MERGE)
    assert st == 422 and list(causes(b)) == ["spec.limits.gpu"]


async def test_a_rule_that_errors_is_a_cause_and_a_rule_that_does_not_compile_refuses_the_crd(cluster):
    """A rule whose evaluation fails (no such key, division by zero) is a cause "... evaluating rule:
    RULE"; a CRD with a rule that does not compile is refused when it is created."""
    emu, api = cluster
    emu.add_crd(widget_crd({"spec": [{"rule": "self.name.size() > 0"}]}))
    st, b, _ = await api("POST", WIDGETS,
                         json={"apiVersion": "test.dev/v1", "kind": "Widget", "metadata": {"name": "w"},
                                                "spec": {"size": 1}})
    assert st == 422 and causes(b)["spec"][1].endswith("evaluating rule: self.name.size() > 0")
    with pytest.raises(ApiError, match="compilation failed"):
        emu.add_crd(widget_crd({"size": [{"rule": "self >= "}]}))


async def test_the_kubernetes_cel_libraries_are_a_gap(cluster):
    """A gap, named: kube-apiserver's CEL has Kubernetes' libraries (strings' lowerAscii and split,
    quantity, url, ip, lists' sum ...) and optional types; cel-python has the CEL standard library
    only, so a rule using them fails here when evaluated, where the real server would run it. The
    ShardedModel CRD uses none of them (a test keeps it so)."""
    emu, api = cluster
    emu.add_crd(widget_crd({"name": [{"rule": "self.lowerAscii() == self"}]}))
    st, b, _ = await api("POST", WIDGETS,
                         json={"apiVersion": "test.dev/v1", "kind": "Widget", "metadata": {"name": "w"},
                                                "spec": {"name": "Abc"}})
    assert st == 422 and "evaluating rule: self.lowerAscii() == self" in causes(b)["spec.name"][1]
    from shard_operator.api.crd import build_crd
    rules = " ".join(expressions(build_crd()))
    assert "filter(" in rules and "type(self)" in rules
    for name in ("lowerAscii", "upperAscii", "split", "quantity", "url(", "ip(", "cidr(", ".sum(", "isSorted", "?."):
        assert name not in rules, f"the ShardedModel CRD uses {name}, which the emulator cannot evaluate"


def expressions(node) -> list[str]:
    """Every rule and messageExpression in a CRD."""
    if isinstance(node, list):
        return [e for item in node for e in expressions(item)]
    if not isinstance(node, dict):
        return []
    own = [r[k] for r in node.get("x-kubernetes-validations") or [] for k in ("rule", "messageExpression") if k in r]
    return own + [e for key, value in node.items() if key != "x-kubernetes-validations" for e in expressions(value)]
