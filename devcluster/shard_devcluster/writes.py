"""The emulated API server's writes: create, patch (merge, JSON, strategic, apply), replace,
the scale and binding subresources, admission, delete with finalizers and graceful deletion, and
the garbage collection of dependents and namespaces."""
import asyncio
import copy
import random
import string
import uuid
from typing import Any

import attrs
import jsonpatch
import yaml

from . import validation
from .apirules import PODS, Admission, ApiError, Key, Res, deletion_grace, in_seconds, now, pod_update, secret_write
from .patches import merge_patch, strategic_merge_patch
from .schemas import structural
from .store import Store


@attrs.define(kw_only=True)
class Writes(Store):
    # ---- write operations ---------------------------------------------------------------
    async def _do_create(self, res: Res, ns: str | None, body: Any, dry: bool = False,
                         admit: Admission | None = None) -> dict:
        if not isinstance(body, dict):
            raise ApiError(400, 'BadRequest', 'the body must be an object')
        meta = body.setdefault('metadata', {})
        if self._namespaced(res):
            if ns is None:
                raise ApiError(405, 'MethodNotAllowed',
                               f'{res.plural} is namespaced: POST to /namespaces/NS/{res.plural}')
            if meta.get('namespace') not in (None, ns):
                raise ApiError(400, 'BadRequest',
                               'the namespace of the provided object does not match the namespace sent on the request')
            meta['namespace'] = ns
            if self.check_namespaces and self._current((Res('v1/namespaces'), None, ns)) is None:
                raise ApiError(404, 'NotFound', f'namespaces "{ns}" not found', {'name': ns, 'kind': 'namespaces'})
        else:
            self._check_scope(res, ns)
            meta.pop('namespace', None)
        if not meta.get('name'):
            if not meta.get('generateName'):
                raise ApiError(422, 'Invalid', 'metadata.name: Required value: name or generateName is required')
            meta['name'] = meta['generateName'] + ''.join(random.choices(string.ascii_lowercase + string.digits, k=5))
        body.setdefault('apiVersion', self._api_version(res))
        body.setdefault('kind', self._kind(res))
        if self._has_sub(res, 'status') and res != Res('v1/nodes'):
            body.pop('status', None)  # (kubelets register Nodes with their status: it is kept)
        for k in ('deletionTimestamp', 'deletionGracePeriodSeconds'):
            meta.pop(k, None)
        body = self._as_stored(res, body, None, None, admit)
        meta = body['metadata']
        key = (res, meta.get('namespace'), meta['name'])  # (validated first, as the real server does)
        if self._current(key) is not None:
            raise ApiError(409, 'AlreadyExists', f'{res.plural} "{meta["name"]}" already exists',
                           {'name': meta['name'], 'group': res.group, 'kind': res.plural})
        if res == Res('v1/services') and not dry:
            spec = body.setdefault('spec', {})
            if not spec.get('clusterIP') and spec.get('type', 'ClusterIP') != 'ExternalName':
                spec['clusterIP'] = self._free_cluster_ip()
                spec['clusterIPs'] = [spec['clusterIP']]
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
        if dry:
            meta['resourceVersion'] = str(self._rv)
            return body
        meta['resourceVersion'] = self._next_rv()
        self._store(key, body)
        await self._emit(res, 'ADDED', body)
        self._collect_if_dangling(body)
        return copy.deepcopy(body)

    def _as_stored(self, res: Res, new: dict, old: dict | None, sub: str | None, admit: Admission | None) -> dict:
        """A written object (`old` None: created) as the server stores it: a Secret's data and
        stringData merged, a schema's unknown fields pruned and defaults set, then admitted."""
        if res == Res('v1/secrets'):
            new = secret_write(old, new)
        if res in self._schemas:
            unknown: list[str] = []
            new = structural(self._schemas[res], new, unknown)
            self._admit(res, new, old, sub, unknown, admit)
        return new

    async def _do_patch(self, res, ns, name, sub, ctype, patch, dry=False, admit=None) -> dict:
        old = self._get_or_404(res, ns, name)
        if sub == 'scale':
            return await self._patch_scale(res, ns, name, old, ctype, patch, dry, admit)
        if sub not in (None, 'status') or (sub == 'status' and not self._has_sub(res, 'status')):
            raise self._not_found(res, f'{name}/{sub}')
        try:
            if ctype == 'application/json-patch+json':
                if not isinstance(patch, list):
                    raise ApiError(400, 'BadRequest', 'json patch must be a list of operations')
                new = jsonpatch.apply_patch(old, patch, in_place=False)
            elif ctype == 'application/strategic-merge-patch+json':
                if res in self._custom:
                    raise ApiError(415, 'UnsupportedMediaType',
                                   'strategic merge patch is not supported for custom resources')
                new = strategic_merge_patch(old, patch)
            elif ctype in ('application/merge-patch+json', 'application/json'):
                if not isinstance(patch, dict):
                    raise ApiError(400, 'BadRequest', 'merge patch must be an object')
                new = merge_patch(old, patch)
            else:
                raise ApiError(415, 'UnsupportedMediaType',
                               f'the body of the request was in an unknown format: {ctype}')
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
            raise ApiError(422, 'Invalid', f'the server rejected our request due to an error in our request: {e}') \
                from e
        # A resourceVersion in the patch acts as a precondition (optimistic locking).
        patched_rv = (new.get('metadata') or {}).get('resourceVersion')
        if patched_rv not in (None, old['metadata']['resourceVersion']):
            raise ApiError(409, 'Conflict', f'Operation cannot be fulfilled on {res.plural} "{name}": '
                           'the object has been modified; '
                           'please apply your changes to the latest version and try again')
        return await self._commit_update(res, ns, name, old, new, sub, dry, admit)

    async def _do_replace(self, res, ns, name, sub, body, dry=False, admit=None) -> dict:
        old = self._get_or_404(res, ns, name)
        if not isinstance(body, dict):
            raise ApiError(400, 'BadRequest', 'the body must be an object')
        if sub == 'scale':
            return await self._patch_scale(res, ns, name, old, 'application/merge-patch+json', body, dry, admit)
        meta = body.setdefault('metadata', {})
        if meta.get('name') not in (None, name):
            raise ApiError(400, 'BadRequest', 'the name of the object does not match the name on the URL')
        rv = meta.get('resourceVersion')
        if rv is not None and rv != old['metadata']['resourceVersion']:
            raise ApiError(409, 'Conflict', f'Operation cannot be fulfilled on {res.plural} "{name}": '
                           'the object has been modified; '
                           'please apply your changes to the latest version and try again')
        return await self._commit_update(res, ns, name, old, body, sub, dry, admit)

    async def _do_apply(self, res, ns, name, sub, request, dry=False, admit=None) -> tuple[int, dict]:
        if not request.params.get('fieldManager'):
            raise ApiError(400, 'BadRequest', 'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value')
        try:
            body = yaml.safe_load(request.text)
        except yaml.YAMLError as e:
            raise ApiError(400, 'BadRequest', f'invalid YAML: {e}') from e
        self._check_scope(res, ns, writing_named=True)
        old = self._current((res, ns, name))
        if old is None:
            if sub:
                raise self._not_found(res, name)
            body.setdefault('metadata', {})['name'] = name
            return 201, await self._do_create(res, ns, body, dry=dry, admit=admit)
        body.get('metadata', {}).pop('resourceVersion', None)
        merge = merge_patch if res in self._custom else strategic_merge_patch
        return 200, await self._commit_update(res, ns, name, old, merge(old, body), sub, dry, admit)

    async def _commit_update(self, res, ns, name, old, new, sub, dry, admit: Admission | None = None) -> dict:
        new = copy.deepcopy(new)
        om, nm = old['metadata'], new.setdefault('metadata', {})
        if sub == 'status':
            # /status: only .status changes are taken.
            merged = copy.deepcopy(old)
            if 'status' in new:
                merged['status'] = new['status']
            else:
                merged.pop('status', None)
            new, nm = merged, merged['metadata']
        else:
            if self._has_sub(res, 'status'):
                # main resource: .status changes are ignored when the status subresource exists.
                if 'status' in old:
                    new['status'] = old['status']
                else:
                    new.pop('status', None)
            # server-managed/immutable metadata
            for k in ('uid', 'creationTimestamp', 'name', 'namespace', 'deletionTimestamp',
                      'deletionGracePeriodSeconds', 'generation'):
                if k in om:
                    nm[k] = om[k]
                else:
                    nm.pop(k, None)
            if om.get('deletionTimestamp'):
                added = set(nm.get('finalizers') or []) - set(om.get('finalizers') or [])
                if added:
                    raise ApiError(422, 'Invalid', 'metadata.finalizers: Forbidden: no new finalizers can be added '
                                   f'if the object is being deleted, found new finalizers {sorted(added)}')
        new.setdefault('apiVersion', old.get('apiVersion'))
        new.setdefault('kind', old.get('kind'))
        new = self._as_stored(res, new, old, sub, admit)
        nm = new['metadata']
        if res == PODS and sub is None:
            pod_update(old, new)
        nm['resourceVersion'] = om['resourceVersion']
        if new == old:
            return old  # no-op: no new resourceVersion, no watch event
        if {k: v for k, v in new.items() if k not in ('metadata', 'status')} != \
           {k: v for k, v in old.items() if k not in ('metadata', 'status')}:
            nm['generation'] = om.get('generation', 1) + 1
        if dry:
            return new
        nm['resourceVersion'] = self._next_rv()
        key = (res, ns, name)
        if nm.get('deletionTimestamp') and not nm.get('finalizers') and not nm.get('deletionGracePeriodSeconds'):
            self._store(key, new)
            self._objects[key].delete()
            await self._emit(res, 'DELETED', new, old)
            self._after_removal(res, new)
            return new
        self._store(key, new)
        await self._emit(res, 'MODIFIED', new, old)
        return copy.deepcopy(new)

    def _admit(self, res: Res, new: dict, old: dict | None, sub: str | None, unknown: list[str],
               admit: Admission | None) -> None:
        """What a custom resource's write must pass over HTTP: the unknown fields pruned from it as
        `fieldValidation` asks (Strict: 400, Warn: a warning each), then its schema and CEL rules
        (validation.py; 422 with a cause per field); a /status write is checked in its status only."""
        if admit is None:
            return  # the in-process API writes as storage would: tests arrange any world with it
        kind = self._kind(res)
        if unknown and admit.field_validation == 'Strict':
            raise ApiError(400, 'BadRequest', f'{kind} in version "{res.version}" cannot be handled as a {kind}: '
                           'strict decoding error: ' + ', '.join(f'unknown field "{p}"' for p in unknown))
        if admit.field_validation == 'Warn':
            admit.warnings += [f'unknown field "{p}"' for p in unknown]
        schema = self._schemas[res]
        if sub == 'status':
            errors = validation.validate((schema.get('properties') or {}).get('status') or {}, new.get('status'),
                                         (old or {}).get('status', validation.MISSING), 'status', admit.warnings) \
                if new.get('status') is not None else []
        else:
            errors = validation.validate(schema, new, validation.MISSING if old is None else old, '', admit.warnings)
        if errors:
            name = new['metadata'].get('name')
            listed = str(errors[0]) if len(errors) == 1 else '[' + ', '.join(map(str, errors)) + ']'
            raise ApiError(422, 'Invalid', f'{kind}.{res.group} "{name}" is invalid: {listed}',
                           {'name': name, 'group': res.group, 'kind': kind, 'causes': [e.cause() for e in errors]})

    async def _do_bind(self, ns, name, binding: Any) -> None:
        """pods/binding (the only way to set spec.nodeName after creation): the pod is assigned to
        the target node and its PodScheduled condition turns True, as kube-apiserver's binding
        storage does; a pod bound or being deleted already is a 409."""
        target = (binding.get('target') or {}).get('name') if isinstance(binding, dict) else None
        if not target:
            raise ApiError(422, 'Invalid', f'Binding "{name}" is invalid: target.name: Required value')
        old = self._get_or_404(PODS, ns, name)
        conflict = (f'pod {name} is being deleted, cannot be assigned to a host'
                    if old['metadata'].get('deletionTimestamp')
                    else f'pod {name} is already assigned to node "{old["spec"]["nodeName"]}"'
                    if (old.get('spec') or {}).get('nodeName') else None)
        if conflict:
            raise ApiError(409, 'Conflict', f'Operation cannot be fulfilled on pods/binding "{name}": {conflict}')
        new = copy.deepcopy(old)
        new.setdefault('spec', {})['nodeName'] = target
        status = new.setdefault('status', {})
        others = [c for c in status.get('conditions') or [] if c.get('type') != 'PodScheduled']
        status['conditions'] = others + [{'type': 'PodScheduled', 'status': 'True', 'lastProbeTime': None,
                                          'lastTransitionTime': now()}]
        new['metadata']['resourceVersion'] = self._next_rv()
        self._store((PODS, ns, name), new)
        await self._emit(PODS, 'MODIFIED', new, old)

    async def _patch_scale(self, res, ns, name, old, ctype, patch, dry, admit=None) -> dict:
        if not self._has_sub(res, 'scale'):
            raise self._not_found(res, f'{name}/scale')
        scale = self._scale_of(res, old)
        new_scale = jsonpatch.apply_patch(scale, patch) if isinstance(patch, list) else merge_patch(scale, patch)
        replicas = (new_scale.get('spec') or {}).get('replicas')
        spec_path = self._scale_paths.get(res, ('.spec.replicas',))[0].strip('.').split('.')
        new = copy.deepcopy(old)
        tgt = new
        for part in spec_path[:-1]:
            tgt = tgt.setdefault(part, {})
        tgt[spec_path[-1]] = replicas
        obj = await self._commit_update(res, ns, name, old, new, None, dry, admit)
        return self._scale_of(res, obj)

    async def _do_delete(self, res, ns, name, opts: dict, dry=False) -> dict:
        old = self._get_or_404(res, ns, name)
        om = old['metadata']
        pre = opts.get('preconditions') or {}
        if (pre.get('uid') not in (None, om.get('uid'))
                or pre.get('resourceVersion') not in (None, om.get('resourceVersion'))):
            raise ApiError(409, 'Conflict', f'Precondition failed for {res.plural} "{name}"')
        policy = opts.get('propagationPolicy') or 'Background'
        new = copy.deepcopy(old)
        nm = new['metadata']
        grace = deletion_grace(old, opts.get('gracePeriodSeconds')) if res == PODS else 0
        if grace is None:
            return old  # a graceful deletion with no shorter period is pending already
        if grace > 0:  # the pod stays, Terminating, until its kubelet deletes it with grace 0
            nm['deletionTimestamp'] = in_seconds(grace)
            nm['deletionGracePeriodSeconds'] = grace
            nm['generation'] = om.get('generation', 1) + 1
            if dry:
                return new
            nm['resourceVersion'] = self._next_rv()
            self._store((res, ns, name), new)
            await self._emit(res, 'MODIFIED', new, old)
            return copy.deepcopy(new)
        if policy == 'Foreground' and self._dependents(om.get('uid')):
            nm['finalizers'] = list(dict.fromkeys((nm.get('finalizers') or []) + ['foregroundDeletion']))
        if policy == 'Orphan':
            nm['finalizers'] = list(dict.fromkeys((nm.get('finalizers') or []) + ['orphan']))
        key = (res, ns, name)
        if nm.get('finalizers'):
            if om.get('deletionTimestamp') and om.get('deletionGracePeriodSeconds') == 0:
                return old
            nm['deletionTimestamp'] = now()
            nm['deletionGracePeriodSeconds'] = 0
            nm['generation'] = om.get('generation', 1) + 1
            if dry:
                return new
            nm['resourceVersion'] = self._next_rv()
            self._store(key, new)
            await self._emit(res, 'MODIFIED', new, old)
            if 'foregroundDeletion' in nm['finalizers'] or 'orphan' in nm['finalizers']:
                self._spawn(self._gc_finalize(res, ns, name, nm['uid'], 'orphan' in nm['finalizers']))
            return copy.deepcopy(new)
        if dry:
            return old
        nm['resourceVersion'] = self._next_rv()
        self._objects[key].delete()
        await self._emit(res, 'DELETED', new, old)
        self._after_removal(res, new)
        return new

    def _dependents(self, uid: str | None) -> list[Key]:
        if not uid:
            return []
        return [key for key, o in self._objects.items() if not o.deleted
                and any(ref.get('uid') == uid for ref in (o.raw.get('metadata', {}).get('ownerReferences') or []))]

    def _after_removal(self, res: Res, obj: dict) -> None:
        uid = obj['metadata'].get('uid')
        if self._dependents(uid):
            self._spawn(self._gc_background(uid))
        if res == Res('v1/namespaces'):
            self._spawn(self._gc_namespace(obj['metadata']['name']))

    def _collect_if_dangling(self, obj: dict) -> None:
        """An object created with owners none of which exists (deleted while its creator did not
        know yet, as a kubelet renewing the Lease of a Node just deleted) is collected as the
        dependents of a deleted owner are: the garbage collector deletes what only absent owners hold."""
        refs = obj['metadata'].get('ownerReferences') or []
        if refs and not any(self._find_uid(ref.get('uid')) for ref in refs):
            self._spawn(self._gc_background(refs[0].get('uid')))

    async def _gc_background(self, uid: str) -> None:
        await asyncio.sleep(self.gc_delay)
        async with self._lock:
            for (r, ns, n) in self._dependents(uid):
                obj = self._current((r, ns, n))
                if obj is None:
                    continue
                others = [ref for ref in obj['metadata'].get('ownerReferences', []) if ref.get('uid') != uid]
                if others and any(self._find_uid(ref.get('uid')) for ref in others):
                    continue  # still owned by someone alive
                try:
                    await self._do_delete(r, ns, n, {'propagationPolicy': 'Background'})
                except ApiError:
                    pass

    async def _gc_finalize(self, res, ns, name, uid, orphan: bool) -> None:
        await asyncio.sleep(self.gc_delay)
        async with self._lock:
            for (r, dns, n) in self._dependents(uid):
                obj = self._current((r, dns, n))
                if obj is None:
                    continue
                if orphan:
                    refs = [ref for ref in obj['metadata'].get('ownerReferences', []) if ref.get('uid') != uid]
                    orphaned = merge_patch(obj, {'metadata': {'ownerReferences': refs or None}})
                    await self._commit_update(r, dns, n, obj, orphaned, None, False)
                else:
                    try:
                        await self._do_delete(r, dns, n, {'propagationPolicy': 'Foreground'})
                    except ApiError:
                        pass
        # Foreground: wait until dependents are gone, then drop our finalizer.
        for _ in range(10000):
            async with self._lock:
                if orphan or not self._dependents(uid):
                    obj = self._current((res, ns, name))
                    if obj is not None:
                        fins = [f for f in obj['metadata'].get('finalizers', [])
                                if f not in ('foregroundDeletion', 'orphan')]
                        await self._commit_update(res, ns, name, obj,
                                                  merge_patch(obj, {'metadata': {'finalizers': fins}}), None, False)
                    return
            await asyncio.sleep(0.01)

    def _find_uid(self, uid: str | None) -> bool:
        return any(not o.deleted and o.raw.get('metadata', {}).get('uid') == uid for o in self._objects.values())

    async def _gc_namespace(self, ns: str) -> None:
        async with self._lock:
            for (r, ons, n), o in list(self._objects.items()):
                if ons == ns and not o.deleted:
                    try:
                        await self._do_delete(r, ons, n, {})
                    except ApiError:
                        pass
