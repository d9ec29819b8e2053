"""The two patch forms a Kubernetes API server applies besides JSON patch (RFC 6902, which the
`jsonpatch` library applies): RFC 7386 merge patch, and strategic merge patch, approximated for the
built-in fields a client patches (lists merged by their key). Plain functions of JSON values, so the
fast tier's in-memory store patches as the emulated API server does without importing it."""

from __future__ import annotations

import copy
from typing import Any

SMP_MERGE_KEYS = {
    'containers': 'name', 'initContainers': 'name', 'ephemeralContainers': 'name',
    'volumes': 'name', 'env': 'name', 'volumeMounts': 'mountPath', 'ports': 'containerPort',
    'conditions': 'type', 'ownerReferences': 'uid', 'imagePullSecrets': 'name',
    'hostAliases': 'ip', 'topologySpreadConstraints': 'topologyKey',
}
SMP_SET_LISTS = {'finalizers'}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """An approximation of K8s strategic merge patch for the common built-in fields."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get('$patch') == 'replace':
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != '$patch'}
    result = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith('$deleteFromPrimitiveList/'):
            field = k.split('/', 1)[1]
            result[field] = [x for x in result.get(field, []) if x not in v]
        elif k.startswith('$'):
            continue
        elif v is None:
            result.pop(k, None)
        elif isinstance(v, list) and k in SMP_SET_LISTS:
            old = list(result.get(k) or [])
            result[k] = old + [x for x in v if x not in old]
        elif isinstance(v, list) and k in SMP_MERGE_KEYS and isinstance(result.get(k), list):
            mk = SMP_MERGE_KEYS[k]
            merged = [copy.deepcopy(x) for x in result[k]]
            for item in v:
                idx = next((i for i, x in enumerate(merged) if isinstance(x, dict) and isinstance(item, dict)
                            and x.get(mk) == item.get(mk)), None)
                if isinstance(item, dict) and item.get('$patch') == 'delete':
                    if idx is not None:
                        merged.pop(idx)
                elif idx is None:
                    merged.append(copy.deepcopy(item))
                else:
                    merged[idx] = strategic_merge_patch(merged[idx], item)
            result[k] = merged
        else:
            result[k] = strategic_merge_patch(result.get(k), v)
    return result
