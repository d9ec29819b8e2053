"""What a cluster admin allows a ShardedModel to ask for: the trust model's allow-lists.

Whoever may create a ShardedModel in a namespace gets pods there that run an image, mount volumes
and Secrets, as the operator builds them (docs/operations.md, "Trust model"). Without limits that
is as much as creating pods directly; a cluster that grants ShardedModels to people it would not
grant pods narrows it with three lists (chart values, operator settings), each refused with the
NotAllowed condition, never a pod:

- worker images: `spec.worker.image` (or the operator's default) must match one of
  `allowed_images` (shell-style globs, e.g. `registry.example.com/shard-worker:*`);
- hostPath volumes: the directory must lie under one of `allowed_host_paths` (whole path
  components: `/models` allows `/models/llama`, not `/models-other` nor `/`);
- the API key's Secret: `spec.worker.apiKeySecret.name` must match one of
  `allowed_api_key_secrets` (globs; the operator cannot read Secrets, so it judges the name).

Pure: a spec and the lists in, the reasons out.
"""

from __future__ import annotations

import posixpath
from fnmatch import fnmatchcase

from .api import ShardedModelSpec, SpecError


class NotAllowed(SpecError):
    """The spec asks for something the operator's allow-lists refuse."""


def host_path(spec: ShardedModelSpec) -> str | None:
    """The node directory the rank pods would mount, if any (manifests._model_volume)."""
    volume = spec.model.volume
    if volume is None:
        return spec.model.path if spec.model.path.startswith("/") else None
    return volume.host_path.path if volume.host_path is not None else None


def under(path: str, prefix: str) -> bool:
    """`path` is `prefix` or lies below it, comparing whole normalized components."""
    path, prefix = posixpath.normpath(path), posixpath.normpath(prefix)
    return prefix == "/" or path == prefix or path.startswith(prefix.rstrip("/") + "/")


def refusals(spec: ShardedModelSpec, image: str, allowed_images: tuple[str, ...],
             allowed_host_paths: tuple[str, ...], allowed_api_key_secrets: tuple[str, ...]) -> list[str]:
    """Why the spec is not allowed (empty: it is). `image`: the worker image the pods would run."""
    out = []
    if not any(fnmatchcase(image, pattern) for pattern in allowed_images):
        out.append(f"spec.worker.image {image!r} is not among the images this operator allows "
                   f"({', '.join(allowed_images) or 'none'})")
    path = host_path(spec)
    if path is not None and (".." in path.split("/") or not any(under(path, p) for p in allowed_host_paths)):
        out.append(f"hostPath {path!r} is not under a directory this operator allows "
                   f"({', '.join(allowed_host_paths) or 'none'})")
    secret = spec.worker.api_key_secret
    if secret is not None and not any(fnmatchcase(secret.name, p) for p in allowed_api_key_secrets):
        out.append(f"spec.worker.apiKeySecret {secret.name!r} is not a Secret this operator may mount "
                   f"({', '.join(allowed_api_key_secrets) or 'none'})")
    return out


def admit(spec: ShardedModelSpec, image: str, allowed_images: tuple[str, ...], allowed_host_paths: tuple[str, ...],
          allowed_api_key_secrets: tuple[str, ...]) -> None:
    reasons = refusals(spec, image, allowed_images, allowed_host_paths, allowed_api_key_secrets)
    if reasons:
        raise NotAllowed("; ".join(reasons) + " (the operator's allow-lists: docs/operations.md, Trust model)")
