"""`spec.model`: where the checkpoint lives (a volume: PVC, hostPath or image), its path inside,
and how it runs (dtype, quantization, the lengths that size the KV cache); and the local directory
it stands for when planned without a cluster."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .base import NO_DOTDOT, ApiModel, Dtype, Quantization, SpecError, normal_path, to_snake


class PvcSource(ApiModel):
    claim_name: str = Field(min_length=1, description="Name of a PersistentVolumeClaim in the model's namespace.")


class HostPathSource(ApiModel):
    path: str = Field(min_length=1, description="Directory on every node of the pool: absolute, no '..'.",
                      json_schema_extra={"pattern": NO_DOTDOT.replace("^", "^/", 1)})

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"must be an absolute path without '..' segments (got {path!r})")
        return normal_path(path)


class ImageSource(ApiModel):
    reference: str = Field(min_length=1, description="OCI image holding the model files (image volume).")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class ModelVolume(ApiModel):
    """Where the checkpoint lives. Exactly one source; mounted read-only at /models in workers."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "[has(self.pvc), has(self.hostPath), has(self.image)].filter(x, x).size() == 1",
        "message": "give exactly one of pvc, hostPath or image"}]})

    pvc: PvcSource | None = None
    host_path: HostPathSource | None = None
    image: ImageSource | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelVolume:
        given = [name for name in ("pvc", "hostPath", "image")
                 if getattr(self, to_snake(name)) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of pvc, hostPath or image (got {given or 'none'})")
        return self


class ModelSpec(ApiModel):
    volume: ModelVolume | None = None  # before `path`, whose check depends on it
    path: str = Field(min_length=1, json_schema_extra={"pattern": NO_DOTDOT}, description=(
        "Model directory (config.json + safetensors). With a volume: a path inside it, relative "
        "to its root (a leading / is that root), without '..' segments. Without one: an absolute "
        "path on the node, or for `shardctl` a path relative to the YAML file (which alone may "
        "use '..')."))

    @field_validator("path")
    @classmethod
    def _inside_volume(cls, path: str, info: ValidationInfo) -> str:
        in_volume = info.data.get("volume") is not None
        if ".." in path.split("/"):
            if in_volume:
                raise ValueError(f"must stay inside the volume: no '..' segments (got {path!r})")
            if path.startswith("/"):
                raise ValueError(f"a path on the node must not have '..' segments (got {path!r})")
        return (normal_path(path).lstrip("/") or ".") if in_volume else normal_path(path)
    dtype: Dtype = Field("auto", description="Runtime dtype; auto keeps the checkpoint's.")
    quantization: Quantization = Field("none", description=(
        "Weight-only quantization at load: int8 stores the decoder layers' projections as int8 with "
        "one scale per output row (about half of bfloat16's bytes); embeddings, norms and the LM "
        "head stay in dtype, and so do activations."))
    max_model_len: int | None = Field(None, ge=1, description=(
        "Longest sequence (prompt + generated) served; sizes the KV cache. Default: the model's "
        "max_position_embeddings, at most 4096."))
    max_batch_size: int | None = Field(None, ge=1, description=(
        "The most sequences running at once (a cap: the KV cache is sized by spec.serving); each "
        "running row costs memory beside the KV cache (the sampler, the captured decode steps, the "
        "block masks). Default on GPUs: the largest power of two up to 256 that leaves each rank's "
        "KV cache room for one maxModelLen sequence (status.plan.reason says when it is less); on "
        "CPUs 1."))


def inside(root: Path, path: str, field: str = "spec.model.path", within: str = "the volume") -> Path:
    """`root / path` with symlinks resolved, when it stays inside `root` (resolved too).

    The message says only that `field` must stay inside: it does not tell whether anything outside
    exists (nothing outside is named, and the answer does not depend on it)."""
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(real_root / path))
    if not real.is_relative_to(real_root):
        raise SpecError(f"{field} must stay inside {within}")
    return real


def resolve_model_dir(model: ModelSpec, base: str | os.PathLike[str] | None = None) -> Path:
    """The local directory of the model, when it can be known without a cluster.

    A PVC or an image is out of reach, so the directory of the YAML file (`base`) stands for its
    root: a spec that names a volume is planned from a local copy kept at the same path beside it.
    """
    if model.volume is not None and model.volume.host_path is not None:
        return inside(Path(model.volume.host_path.path), model.path)
    if model.volume is not None:
        local = Path(base) / model.path if base is not None else None
        if local is None or not local.is_dir():
            kind = "a PVC" if model.volume.pvc is not None else "an image"
            where = f" (no {local})" if local is not None else ""
            raise SpecError(f"spec.model.volume is {kind}: pass --model-dir with a local copy of the model "
                            f"(its config.json is enough to plan), or keep one at spec.model.path beside the "
                            f"YAML file{where}")
        return local
    path = Path(model.path)
    return path if path.is_absolute() or base is None else Path(base) / path
