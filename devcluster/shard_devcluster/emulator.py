"""An emulated Kubernetes API server for the operator's tests and the one-machine dev cluster,
served over HTTP on loopback.

`FidelityEmulator` extends kmock's KubernetesEmulator (pinned: kmock==0.8, whose internals this
relies on) with the API-server semantics the real kopf operator, the real `kubernetes` client and
real `kubectl` rely on, as kube-apiserver v1.36 behaves. Its `/version` says v1.33.0 all the same:
the release of the kubectl the tests use, which then warns of no version skew.
`tests/operator/integration/test_emulator_conformance.py` probes each of them over raw HTTP, and
says which real behaviour each mimics.

* server-populated metadata: uid, resourceVersion (global counter), creationTimestamp,
  generation, namespace from the URL, generateName; kind/apiVersion on lists & items;
* PATCH flavours by Content-Type: merge (RFC 7386), JSON patch (RFC 6902, 422 on failed
  'test'), strategic-merge (approximation: merge keys for containers/env/ports/...,
  set-merge of finalizers; 415 for custom resources), server-side apply (~ upsert+merge);
* PUT (replace), optimistic concurrency (409 on stale metadata.resourceVersion);
* status & scale subresources (spec/status isolation), generation bumps on spec changes;
* finalizers + deletionTimestamp (no new finalizers while deleting), DELETE with
  preconditions, deletecollection, namespace deletion cascade;
* graceful deletion of pods: a pod a kubelet runs gets a deletionTimestamp and grace period and
  stays until its kubelet deletes it with grace 0 (or the pod GC does); unscheduled and finished
  pods go at once;
* pods: spec updates refused but for images and added tolerations; spec.nodeName is set through
  the pods/binding subresource only;
* ownerReference garbage collection (background / foreground / orphan);
* list/watch: labelSelector, fieldSelector, limit/continue, resourceVersion resume,
  watch ADDED/DELETED transitions on selector changes, bookmarks, sendInitialEvents,
  timeoutSeconds, stream end on client disconnect, race-free snapshot+subscribe;
* ClusterIP allocation for Services: a random free address of `service_cidr`;
* Secrets: `stringData` folded into base64 `data`, `type` defaulted and fixed, keys and base64
  validated, `immutable` enforced;
* custom resources: unknown fields pruned and defaults applied from the CRD's schema (schemas.py),
  then, for HTTP writes, `fieldValidation` (Strict: 400 naming the unknown fields, Warn (the
  default): a Warning header each) and the schema's validations and CEL rules (validation.py: 422
  with a cause per field; ratcheting on updates; a /status write checks its status only); the
  in-process API stores what it is given, as storage would;
* scope checks (namespaced vs cluster-scoped), K8s-conformant Status errors (NotFound,
  AlreadyExists, Conflict, Invalid, ...);
* for kubectl: server-side tables for every kind, in watches too (tables.py), OpenAPI v3 with the
  CRD's schema (`kubectl explain`), /version v1.33.0 (above);
* pods/log from the kubelet of the pod's node, at the endpoint its Node status names;
* pods/proxy (GET): forwarded to the pod's IP and port, its answer returned as it is;
* every request is kept for assertions (`api_requests()`), e.g. that the operator uses only the
  permissions it declares;
* fault injection (`faults=Faults(...)`): on a seeded fraction of requests, the 500s, 409s, 504s,
  slow answers and cut watch streams of a real API server under load or across a restart.

The scheduler, node lifecycle, pod GC and endpoints controllers are components of their own
(controlplane.py). Not emulated: the other built-in controllers (Deployments, ...), RBAC,
admission webhooks, validation of built-in kinds (but Secrets and pod updates), managedFields,
protobuf bodies, pods/portforward and pods/exec (SPDY or WebSocket streams: 400 here).

Also an in-process API (k8s_create/k8s_patch/k8s_delete/k8s_get/k8s_list/k8s_bind/k8s_watch) for
the control plane's components and for tests that arrange the world.
"""
import asyncio
import copy
import json
import re
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp.web
import attrs
import kmock
from kmock._internal import enums, parsing, rendering

from .apirules import (
    NAMESPACE_PATH,
    PODS,
    STREAMS,
    Admission,
    ApiError,
    Res,
    parse_field_selector,
    parse_label_selector,
)
from .reads import Reads
from .schemas import OPENAPI_V2, OPENAPI_V2_TYPE, openapi_v3


@attrs.define(kw_only=True)
class FidelityEmulator(Reads):
    """The whole server: its layers (store.py, writes.py, reads.py) behind kmock's HTTP entry point."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.load_builtin_resources:
            self.resources.load_bundled()
        self.fallback[enums.method.PUT] << self._serve_result
        self.fallback[enums.method.DELETE] << self._serve_result  # deletecollection (no name)
        self.fallback['get /openapi/v2'] << self._serve_openapi_v2
        self.fallback['get /openapi/v3'] << self._serve_openapi_v3_root
        self.fallback['get', re.compile(r'/openapi/v3/apis?/.+')] << self._serve_openapi_v3_gv

    # ---- in-process API ---------------------------------------------------------------
    async def k8s_get(self, res, namespace, name) -> dict | None:
        async with self._lock:
            return self._current((Res(res), namespace, name))

    async def k8s_list(self, res, namespace=None, label_selector=None, field_selector=None) -> list[dict]:
        res = Res(res)
        lcheck, fcheck = parse_label_selector(label_selector), parse_field_selector(field_selector)
        async with self._lock:
            return [copy.deepcopy(o.raw) for (r, ns, n), o in self._of(res)
                    if not o.deleted and (namespace is None or ns == namespace)
                    and lcheck(o.raw.get('metadata', {}).get('labels') or {}) and fcheck(o.raw)]

    async def k8s_count(self, res, namespace=None, label_selector=None, where=None) -> int:
        """How many objects match (no copies: cheap enough to poll in benchmarks)."""
        res = Res(res)
        lcheck = parse_label_selector(label_selector)
        async with self._lock:
            return sum(1 for (r, ns, n), o in self._of(res)
                       if not o.deleted and (namespace is None or ns == namespace)
                       and lcheck(o.raw.get('metadata', {}).get('labels') or {}) and (where is None or where(o.raw)))

    async def k8s_create(self, res, namespace, body) -> dict:
        async with self._lock:
            return await self._do_create(Res(res), namespace, copy.deepcopy(body))

    async def k8s_patch(self, res, namespace, name, patch, *, subresource=None,
                        content_type='application/merge-patch+json') -> dict:
        async with self._lock:
            return await self._do_patch(Res(res), namespace, name, subresource, content_type, patch)

    async def k8s_delete(self, res, namespace, name, propagation='Background', grace: int | None = None) -> dict:
        opts = {'propagationPolicy': propagation, **({'gracePeriodSeconds': grace} if grace is not None else {})}
        async with self._lock:
            return await self._do_delete(Res(res), namespace, name, opts)

    async def k8s_bind(self, namespace, name, node) -> None:
        """POST pods/<name>/binding: what a scheduler does."""
        async with self._lock:
            await self._do_bind(namespace, name, {'target': {'kind': 'Node', 'name': node}})

    async def k8s_watch(self, res) -> AsyncIterator[dict]:
        """ADDED for every object there is, then every change: an in-process informer's feed for
        the control plane's components. The events are shared: never change them."""
        res = Res(res)
        bus = self._buses[res]
        async with self._lock:  # snapshot + subscribe atomically
            mark = await bus.mark()
            existing = [copy.deepcopy(o.raw) for _, o in self._of(res) if not o.deleted]
        try:
            for obj in existing:
                yield {'type': 'ADDED', 'object': obj}
            async for event in bus.stream(since=mark):
                yield event
        finally:
            await bus.unmark(mark)

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """kmock's entry point, but for requests on the Namespace resource, which its URL parser
        cannot read (/api/v1/namespaces fails it; /api/v1/namespaces/X is namespace X's scope to it)."""
        match = NAMESPACE_PATH.fullmatch(raw_request.path)
        if match is None:
            return await super().__call__(raw_request)
        name, sub = match.groups()
        body = await raw_request.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        path = parsing.ParsedPath(group='', version='v1', plural='namespaces', name=name, subresource=sub)
        request = rendering.Request(
            id=len(self._requests), raw_request=raw_request, url=raw_request.url, method=raw_request.method,
            params=dict(raw_request.query), headers=dict(raw_request.headers), cookies=dict(raw_request.cookies),
            body=body, text=body.decode(errors='replace'), data=data, resource=Res('v1/namespaces'), name=name,
            subresource=sub, action=parsing.guess_k8s(path, enums.method(raw_request.method), dict(raw_request.query)))
        self._requests.append(request)
        return await self._handle(request)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or not self._known(res):
            return await kmock.RawHandler._handle(self, request)  # discovery, 404s, user reactions
        method = request.method.value if hasattr(request.method, 'value') else str(request.method)
        watch = method == 'GET' and request.action == enums.action.WATCH
        faults = self.faults
        fault = faults.draw(method, request.url.path, watch) if faults is not None else None
        if fault == 'error':
            injected = ApiError(500, 'InternalError',
                                'Internal error occurred: etcdserver: request timed out (injected)')
            return aiohttp.web.json_response(injected.status(), status=injected.code)
        if fault == 'conflict':
            injected = ApiError(409, 'Conflict', f'Operation cannot be fulfilled on {res.plural} "{request.name}": '
                                'the object has been modified; please apply your changes to the latest version and '
                                'try again (injected)')
            return aiohttp.web.json_response(injected.status(), status=injected.code)
        if faults is not None and fault in ('slow', 'timeout') and method == 'GET':
            await asyncio.sleep(faults.delay)  # (a read: nothing to apply first)
        try:
            ns, name, sub = request.namespace, request.name, request.subresource
            if res == PODS and sub in STREAMS:
                raise ApiError(400, 'BadRequest',
                               f'pods/{sub} is not served by the dev cluster\'s API server (a SPDY or '
                               'WebSocket stream): reach the pod at its IP, or a Service at its address, '
                               'through the dev cluster\'s HTTP proxy (docs/dev-cluster.md)')
            result: tuple[int, Any] | None = None
            dry = request.params.get('dryRun') == 'All'
            admit = Admission.of(request.params) if method in ('POST', 'PUT', 'PATCH') else None
            if method == 'POST' and name is None:
                async with self._lock:
                    body = self._parse_body(request)
                    result = 201, await self._do_create(res, ns, body, dry=dry, admit=admit)
            elif method == 'PUT' and name is not None:
                async with self._lock:
                    result = 200, await self._do_replace(res, ns, name, sub, self._parse_body(request), dry=dry,
                                                         admit=admit)
            elif method == 'PATCH' and name is not None:
                ctype = self._header(request, 'Content-Type') or 'application/merge-patch+json'
                async with self._lock:
                    if ctype.startswith('application/apply-patch'):
                        result = await self._do_apply(res, ns, name, sub, request, dry=dry, admit=admit)
                    else:
                        result = 200, await self._do_patch(res, ns, name, sub, ctype, self._parse_body(request),
                                                           dry=dry,
                                                           admit=admit)
            elif method == 'POST' and res == PODS and sub == 'binding':
                async with self._lock:
                    await self._do_bind(ns, name, self._parse_body(request))
                result = 201, {'kind': 'Status', 'apiVersion': 'v1', 'metadata': {}, 'status': 'Success', 'code': 201}
            elif method == 'DELETE' and name is not None:
                opts = dict(request.data) if isinstance(request.data, dict) else {}
                for key in ('propagationPolicy', 'gracePeriodSeconds'):
                    if key in request.params:
                        opts[key] = request.params[key]
                async with self._lock:
                    result = 200, await self._do_delete(res, ns, name, opts, dry=dry)
            elif method == 'DELETE' and name is None:
                self._check_scope(res, ns)
                items = await self.k8s_list(res, ns, request.params.get('labelSelector'),
                                            request.params.get('fieldSelector'))
                deleted = []
                async with self._lock:
                    for item in items:
                        deleted.append(await self._do_delete(res, item['metadata'].get('namespace'),
                                                             item['metadata']['name'], {}, dry=dry))
                result = 200, {'kind': f'{self._kind(res)}List', 'apiVersion': self._api_version(res),
                               'metadata': {'resourceVersion': str(self._rv)}, 'items': deleted}
            elif method == 'GET':
                self._check_scope(res, ns, writing_named=name is not None)
        except ApiError as e:
            return aiohttp.web.json_response(e.status(), status=e.code)
        if faults is not None and fault in ('slow', 'timeout') and method != 'GET':
            await asyncio.sleep(faults.delay)  # after the work: the write has landed
        if fault == 'timeout':
            injected = ApiError(504, 'Timeout', 'Timeout: request did not complete within the allotted timeout '
                                '(injected)')
            return aiohttp.web.json_response(injected.status(), status=injected.code)
        # Known resources are served directly: kmock's reaction matching costs ~0.1 s a request
        # with thousands of objects. (So kmock DSL reactions apply to unknown paths only.)
        if result is not None:
            response = await rendering.Response(status=result[0], payload=result[1])(request)
            for warning in admit.warnings if admit is not None else ():  # (as client-go reads them)
                response.headers.add('Warning', '299 - ' + json.dumps(warning))
            return response
        if method == 'GET':
            serve = {enums.action.WATCH: self._serve_watch, enums.action.LIST: self._serve_list,
                     enums.action.FETCH: self._serve_fetch}.get(request.action) if request.action else None
            if serve is not None:
                return await (await serve(request))(request)
        return await kmock.RawHandler._handle(self, request)

    # Fallback reactions registered by the base class for writes.
    async def _serve_result(self, request):
        # _handle() answers every method on known resources itself; this is what is left.
        if not self._known(request.resource):
            return self._unknown_response(request.resource)
        return rendering.Response(status=405, payload=ApiError(405, 'MethodNotAllowed', 'method not allowed').status())

    _serve_create = _serve_update = _serve_delete = _serve_result

    # ---- discovery fixes ---------------------------------------------------------------------
    async def _serve_version(self, request):
        result = cast(dict[str, Any], await super()._serve_version(request))
        if result.get('groupVersion', '').startswith('/'):  # /api/v1 must say "v1", not "/v1"
            result['groupVersion'] = result['groupVersion'].lstrip('/')
        for r in result.get('resources', []):
            if r.get('namespaced') is None:
                r['namespaced'] = True
            if '/' in r['name']:  # subresources: no short names/categories (kubectl warns otherwise)
                sub = r['name'].split('/', 1)[1]
                r['shortNames'], r['categories'] = [], []
                r['verbs'] = ['get', 'patch', 'update'] if sub in ('status', 'scale') else ['create', 'get']
                if sub == 'scale':
                    r.update(kind='Scale', group='autoscaling', version='v1')
        return result

    async def _serve_server_version(self, request):
        major, minor = self.version.lstrip('v').split('.')[:2]
        return {'major': major, 'minor': minor, 'gitVersion': self.version, 'gitTreeState': 'clean',
                'goVersion': 'go1.24', 'compiler': 'gc', 'platform': 'linux/amd64'}

    async def _serve_openapi_v2(self, request):
        return rendering.Response(status=200, headers={'Content-Type': OPENAPI_V2_TYPE}, payload=OPENAPI_V2)

    async def _serve_openapi_v3_root(self, request):
        paths = {}
        for res in self._get_resources():
            gv = f'api/{res.version}' if not res.group else f'apis/{res.group}/{res.version}'
            paths[gv] = {'serverRelativeURL': f'/openapi/v3/{gv}?hash={self._rv}'}
        return {'paths': paths}

    async def _serve_openapi_v3_gv(self, request):
        parts = request.url.path.strip('/').split('/')[2:]  # api/v1 | apis/g/v
        group, version = ('', parts[1]) if parts[0] == 'api' else (parts[1], parts[2])
        preserve = {'type': 'object', 'x-kubernetes-preserve-unknown-fields': True}
        kinds = [(res.plural, self._kind(res), self._namespaced(res), self._schemas.get(res, preserve))
                 for res in self._get_resources() if res.group == group and res.version == version and res.plural]
        return openapi_v3(group, version, kinds)

    async def __aenter__(self):
        result = await super().__aenter__()
        for ns in self.default_namespaces:  # a real cluster has them; kopf's namespace observer needs them
            if await self.k8s_get('v1/namespaces', None, ns) is None:
                await self.k8s_create('v1/namespaces', None, {'metadata': {'name': ns}, 'status': {'phase': 'Active'}})
        return result

    async def __aexit__(self, *exc) -> None:
        for t in list(self._bg_tasks):
            t.cancel()
        await super().__aexit__(*exc)
