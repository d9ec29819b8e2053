"""What kube-apiserver does with a CustomResourceDefinition's structural schema, and the OpenAPI
documents it publishes. Pure.

* `structural(schema, obj, unknown)`: unknown fields pruned (their paths added to `unknown`, for
  `fieldValidation`), nulls of non-nullable fields dropped, and defaults applied, as the apiserver
  does to every custom resource it is sent (apiextensions-apiserver: pruning, then defaulting of
  the request body; `x-kubernetes-preserve-unknown-fields` keeps what it covers, `metadata` is the
  server's own). Validating the result is validation.py's.
* `openapi_v3(...)`: the `/openapi/v3/apis/<group>/<version>` document, with each kind's schema
  under its reverse-domain name and `x-kubernetes-group-version-kind`, which is what `kubectl
  explain` reads; every write path declares `fieldValidation`, so kubectl leaves validation to the
  server.
* `OPENAPI_V2`: `/openapi/v2` as protobuf with no definitions: kubectl validates a `kind: List`
  client-side against it (a List has no server-side schema), finds no schema for its items and
  leaves them to the server.
"""

from __future__ import annotations

import copy
from typing import Any

SERVER_FIELDS = ('apiVersion', 'kind', 'metadata')


def structural(schema: dict[str, Any], obj: Any, unknown: list[str] | None = None) -> Any:
    """`obj` pruned of the fields `schema` does not declare (their paths added to `unknown`), with
    the schema's defaults filled in."""
    return _walk(schema, copy.deepcopy(obj), '', unknown if unknown is not None else [], top=True)


def _walk(schema: dict[str, Any], value: Any, path: str, unknown: list[str], top: bool = False) -> Any:
    if isinstance(value, dict) and schema.get('type', 'object') == 'object':
        properties = schema.get('properties')
        extra = schema.get('additionalProperties')
        keep = schema.get('x-kubernetes-preserve-unknown-fields') or extra is True
        out = {}
        for key, item in value.items():
            where = f'{path}.{key}' if path else key
            if top and key in SERVER_FIELDS:
                out[key] = item
            elif properties and key in properties:
                if item is not None or properties[key].get('nullable'):  # (a null then takes the default)
                    out[key] = _walk(properties[key], item, where, unknown)
            elif isinstance(extra, dict):
                out[key] = _walk(extra, item, where, unknown)
            elif keep or (properties is None and extra is None and schema.get('type') is None):
                out[key] = item
            else:
                unknown.append(where)
        for key, sub in (properties or {}).items():
            if key not in out and 'default' in sub:
                out[key] = _walk(sub, copy.deepcopy(sub['default']), '', [])
        return out
    if isinstance(value, list) and isinstance(schema.get('items'), dict):
        return [_walk(schema['items'], item, f'{path}[{i}]', unknown) for i, item in enumerate(value)]
    return value


def reverse_domain(group: str) -> str:
    return '.'.join(reversed(group.split('.'))) if group else 'io.k8s.api.core'


def openapi_v3(group: str, version: str, kinds: list[tuple[str, str, bool, dict[str, Any]]]) -> dict[str, Any]:
    """The OpenAPI v3 document of one group-version: (plural, kind, namespaced, schema) per kind."""
    field_validation = {'name': 'fieldValidation', 'in': 'query', 'schema': {'type': 'string', 'uniqueItems': True}}
    prefix = f'/apis/{group}/{version}' if group else f'/api/{version}'
    paths, schemas = {}, {}
    for plural, kind, namespaced, schema in kinds:
        gvk = {'group': group, 'version': version, 'kind': kind}
        name = f'{reverse_domain(group)}.{version}.{kind}'
        ref = {'content': {'application/json': {'schema': {'$ref': f'#/components/schemas/{name}'}}}}
        write = {'x-kubernetes-group-version-kind': gvk, 'parameters': [field_validation],
                 'requestBody': ref, 'responses': {'200': {'description': 'OK', **ref}}}
        read = {'x-kubernetes-group-version-kind': gvk, 'responses': {'200': {'description': 'OK', **ref}}}
        base = prefix + ('/namespaces/{namespace}' if namespaced else '')
        paths[f'{base}/{plural}'] = {'get': read, 'post': write}
        paths[f'{base}/{plural}/{{name}}'] = {'get': read, 'put': write, 'patch': write}
        schemas[name] = {**schema, 'x-kubernetes-group-version-kind': [gvk]}
    return {'openapi': '3.0.0', 'info': {'title': 'Kubernetes', 'version': version}, 'paths': paths,
            'components': {'schemas': schemas}}


def _proto_field(field: int, data: bytes) -> bytes:
    """One length-delimited protobuf field (short: under 128 bytes)."""
    return bytes([field << 3 | 2, len(data)]) + data


# gnostic's openapi_v2.Document: swagger = 1, info = 2 (an Info: title = 1, version = 2).
OPENAPI_V2 = _proto_field(1, b'2.0') + _proto_field(2, _proto_field(1, b'Kubernetes') + _proto_field(2, b'v1'))
OPENAPI_V2_TYPE = 'application/com.github.proto-openapi.spec.v2.v1.0+protobuf'
