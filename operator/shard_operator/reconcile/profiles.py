"""Where a model's profile comes from: its own files, read by the operator or by a profiling Pod.

When the operator can see the checkpoint (a hostPath under `host_path_prefix`, a PVC under
`pvc_root`), it reads config.json and the safetensors headers itself, cached per directory until a
file changes. Otherwise it starts a short Pod (worker image, the model's volume mounted read-only)
that prints the profile; the operator stores it in a ConfigMap owned by the ShardedModel, keyed by
the model's source (volume + path) and recording the checkpoint digest, and deletes the Pod. A
failed profiling Pod is kept (for `kubectl logs`) until the model's source changes.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from shard_contract.checkpoint import CheckpointError, CheckpointFacts

from ..api import ShardedModelSpec, inside
from ..objects.manifests import (
    COMPONENT_LABEL,
    PROFILE_KEY,
    SOURCE_ANNOTATION,
    Context,
    model_source,
    profile_name,
    profile_record,
    profiling_pod,
)
from ..planning.profile import ModelProfile, profile_from_facts, profile_model
from ..settings import Settings
from .writes import Write


class ModelNotFound(CheckpointError):
    """The model's directory is not there (a wrong path, or the volume is not what the spec says)."""


def local_model_dir(spec: ShardedModelSpec, settings: Settings) -> Path | None:
    """The model directory as the operator sees it (symlinks resolved), or None when it cannot see
    that volume. A path that leads out of its volume (through a symlink: the spec cannot say `..`)
    is a SpecError that does not tell whether anything outside exists."""
    model, volume = spec.model, spec.model.volume
    if volume is None or volume.host_path is not None:
        if settings.host_path_prefix is None:
            return None
        node = Path(settings.host_path_prefix or "/")  # the node's filesystem, as mounted here
        if volume is None:
            return inside(node, model.path.lstrip("/"), within="the node's filesystem")
        assert volume.host_path is not None
        root = inside(node, volume.host_path.path.lstrip("/"), "spec.model.volume.hostPath.path",
                      within="the node's filesystem")
        return inside(root, model.path)
    if volume.pvc is not None and settings.pvc_root is not None:
        return inside(Path(settings.pvc_root) / volume.pvc.claim_name, model.path)
    return None


def _signature(model_dir: Path) -> tuple:
    """Changes whenever config.json or a checkpoint file is replaced or rewritten."""
    entries: list[tuple[str, int | None, int | None]] = []
    for path in sorted(model_dir.iterdir()):
        if path.name == "config.json" or path.suffix == ".safetensors" or path.name.endswith(".index.json"):
            try:
                stat = path.stat()
            except OSError:  # a dangling link, say: reading the checkpoint names the problem
                entries.append((path.name, None, None))
                continue
            entries.append((path.name, stat.st_size, stat.st_mtime_ns))
    return tuple(entries)


class LocalProfiles:
    """Profiles read from files the operator can see, cached per directory and file signature."""

    def __init__(self) -> None:
        self._cache: dict[Path, tuple[tuple, ModelProfile]] = {}
        self._lock = threading.Lock()

    def get(self, model_dir: Path) -> ModelProfile:
        if not model_dir.is_dir():
            raise ModelNotFound(f"model directory {model_dir} does not exist")
        try:
            signature = _signature(model_dir)
        except OSError as err:
            raise CheckpointError(f"{model_dir}: cannot be listed ({err.strerror})") from None
        with self._lock:
            cached = self._cache.get(model_dir)
        if cached is not None and cached[0] == signature:
            return cached[1]
        profile = profile_model(model_dir)
        with self._lock:
            self._cache[model_dir] = (signature, profile)
        return profile


def _last_json_line(log: str) -> dict[str, Any] | None:
    for line in reversed(log.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict):
            return data
    return None


class LogReader(Protocol):
    def pod_log(self, namespace: str, name: str, tail_lines: int = 200) -> str: ...


def remote_profile(ctx: Context, kube: LogReader, pods: list[dict[str, Any]], configmaps: list[dict[str, Any]],
                   timeout_seconds: float) -> tuple[ModelProfile | None, list[Write]]:
    """The profile from the cache ConfigMap or a profiling Pod (None while the Pod is running), and
    the writes that get there: the Pod created, then its profile recorded and the Pod deleted.

    Raises CheckpointError when the Pod failed (its log says why).
    """
    owner, source = ctx.owner, model_source(ctx.spec)
    name = profile_name(owner.name)
    record = next((c for c in configmaps if c["metadata"]["name"] == name), None)
    if record is not None and (record["metadata"].get("annotations") or {}).get(SOURCE_ANNOTATION) == source:
        try:
            return ModelProfile.model_validate_json((record.get("data") or {}).get(PROFILE_KEY, "")), []
        except ValidationError:
            pass  # written by another version: profile again
    pod = next((p for p in pods if p["metadata"]["name"] == name
                and (p["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == "profiler"), None)
    delete_pod = Write("delete", "Pod", owner.namespace, name)
    if pod is not None and (pod["metadata"].get("annotations") or {}).get(SOURCE_ANNOTATION) != source:
        return None, [delete_pod]  # profiling an old path
    if pod is None:
        return None, [Write.create(profiling_pod(ctx, int(timeout_seconds)))]
    if pod["metadata"].get("deletionTimestamp"):
        return None, []
    phase = (pod.get("status") or {}).get("phase")
    if phase == "Failed":
        tail = kube.pod_log(owner.namespace, name, tail_lines=5).strip() or (pod.get("status") or {}).get("message", "")
        raise CheckpointError(f"profiling pod {name} failed: {tail or 'no output'}")
    if phase != "Succeeded":
        return None, []
    data = _last_json_line(kube.pod_log(owner.namespace, name))
    try:
        facts = CheckpointFacts.model_validate(data)
    except ValidationError as err:
        raise CheckpointError(f"profiling pod {name} printed no checkpoint facts ({err.error_count()} problems)") \
            from None
    profile = profile_from_facts(facts)
    wanted = profile_record(owner, source, profile.model_dump_json())
    keep = Write.create(wanted) if record is None else Write(
        "patch", "ConfigMap", owner.namespace, name,
        {"metadata": {"annotations": wanted["metadata"]["annotations"]}, "data": wanted["data"]})
    return profile, [keep, delete_pod]
