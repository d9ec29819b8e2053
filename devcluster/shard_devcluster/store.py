"""The emulated API server's store: its settings and state (objects, resource versions, watch
history, custom resources and their schemas), the resources it serves, and the small reads and
writes every layer above shares (`writes.py`, `reads.py`, `emulator.py`)."""
import asyncio
import copy
import ipaddress
import json
import random
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import kmock
from kmock._internal import rendering

from . import validation
from .apirules import KUBERNETES_VERSION, ApiError, Faults, Key, Res
from .tables import dig


@attrs.define(kw_only=True)
class Store(kmock.KubernetesEmulator):
    bookmark_interval: float = 60.0     # real API servers: ~1 min
    watch_poll_interval: float = 0.2    # how often to check for client disconnects
    gc_delay: float = 0.0               # delay before background GC of dependents
    check_namespaces: bool = False      # reject objects in non-existent namespaces
    history_limit: int = 10000          # events kept per resource for ?resourceVersion= resume
    default_namespaces: tuple = ('default', 'kube-system', 'kube-public', 'kube-node-lease')
    load_builtin_resources: bool = True  # kmock's bundled K3s discovery snapshot (pods, nodes, ...)
    # Services without spec.clusterIP get a random free address of it, as kube-apiserver's
    # --service-cluster-ip-range allocator does.
    service_cidr: str = '10.96.0.0/12'
    # Failures of a real API server under load, injected into a fraction of requests (None: none).
    faults: Faults | None = None
    # What /version says: the release whose kubectl the tests use (no version-skew warning).
    version: str = KUBERNETES_VERSION
    # Where this process reaches a pod IP (pods/proxy): a real API server dials it as it is; the
    # dev cluster's pod IPs are mapped onto loopback (network.ClusterNetwork.local).
    pod_address: Callable[[str], str] = lambda ip: ip

    _rv: int = attrs.field(default=0, init=False)
    _history: dict = attrs.field(factory=dict, init=False)
    _custom: set = attrs.field(factory=set, init=False)
    _printer_columns: dict = attrs.field(factory=dict, init=False)
    _schemas: dict = attrs.field(factory=dict, init=False)  # custom resource -> its structural schema
    _scale_paths: dict = attrs.field(factory=dict, init=False)
    _bg_tasks: set = attrs.field(factory=set, init=False)
    _known_cache: dict = attrs.field(factory=dict, init=False)
    _info_cache: dict = attrs.field(factory=dict, init=False)
    _by_resource: dict = attrs.field(factory=dict, init=False)  # resource -> keys in self._objects


    # ---- registration helpers ---------------------------------------------------------
    def add_custom_resource(self, key: str, *, kind: str, namespaced: bool = True, singular: str | None = None,
                            shortnames=(), status: bool = True, scale: bool = False,
                            printer_columns: Sequence[dict] = (), schema: dict | None = None,
                            scale_paths=('.spec.replicas', '.status.replicas', '.status.selector')) -> None:
        """Serve a custom resource; `printer_columns` and `schema` as a CRD version has them."""
        res = Res(key)
        self.resources[res] = kmock.ResourceInfo(
            kind=kind, singular=singular or kind.lower(), namespaced=namespaced, shortnames=set(shortnames),
            verbs={'create', 'delete', 'deletecollection', 'get', 'list', 'patch', 'update', 'watch'},
            subresources={s for s, on in (('status', status), ('scale', scale)) if on})
        self._custom.add(res)
        self._known_cache.clear()
        self._info_cache.clear()
        self._printer_columns[res] = list(printer_columns)
        if schema is not None:
            problems = validation.compile_rules(schema)
            if problems:  # (kube-apiserver refuses such a CRD)
                raise ApiError(422, 'Invalid', f'CustomResourceDefinition "{key}" is invalid: ' + '; '.join(problems))
            self._schemas[res] = schema
        self._scale_paths[res] = scale_paths

    def add_crd(self, crd: dict) -> str:
        """Serve the custom resource of a CustomResourceDefinition manifest; returns its key."""
        spec = crd['spec']
        version = next(v for v in spec['versions'] if v.get('served', True))
        subs = version.get('subresources') or {}
        scale = subs.get('scale') or {}
        key = f"{spec['group']}/{version['name']}/{spec['names']['plural']}"
        self.add_custom_resource(
            key, kind=spec['names']['kind'], namespaced=spec.get('scope', 'Namespaced') == 'Namespaced',
            singular=spec['names'].get('singular'), shortnames=spec['names'].get('shortNames') or (),
            status='status' in subs, scale='scale' in subs,
            printer_columns=version.get('additionalPrinterColumns') or [],
            schema=(version.get('schema') or {}).get('openAPIV3Schema'),
            scale_paths=(scale.get('specReplicasPath', '.spec.replicas'),
                         scale.get('statusReplicasPath', '.status.replicas'),
                         scale.get('labelSelectorPath')))
        return key

    def api_requests(self) -> list:
        """Every HTTP request served so far (kmock's parsed requests)."""
        return list(self._requests)

    def _info(self, res: Res) -> kmock.ResourceInfo | None:
        if res not in self._info_cache:  # (kmock's lookup is slow, and asked on every request)
            self._info_cache[res] = self.resources[res] if res in self.resources else None
        return self._info_cache[res]

    def _namespaced(self, res: Res) -> bool:
        info = self._info(res)
        return True if info is None or info.namespaced is None else bool(info.namespaced)

    def _has_sub(self, res: Res, sub: str) -> bool:
        info = self._info(res)
        return bool(info and sub in info.subresources)

    def _kind(self, res: Res) -> str:
        info = self._info(res)
        return (info.kind if info and info.kind else (res.plural or '').capitalize())

    @staticmethod
    def _api_version(res: Res) -> str:
        return f'{res.group}/{res.version}' if res.group else (res.version or '')

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    # ---- object store primitives (call under self._lock) -----------------------------
    def _current(self, key: Key) -> dict | None:
        if key in self._objects and not self._objects[key].deleted:
            return copy.deepcopy(self._objects[key].raw)
        return None

    def _store(self, key: Key, obj: dict) -> None:
        if key not in self._objects:
            self._objects[key] = obj
        else:
            self._objects[key].history.append(obj)

    def _of(self, res: Res):
        """(key, object) of one resource, deleted ones included: lists need not scan everything."""
        if len(self._objects) != sum(map(len, self._by_resource.values())):  # (re)index lazily
            self._by_resource.clear()
            for key in self._objects:
                self._by_resource.setdefault(key[0], []).append(key)
        for key in self._by_resource.get(res, ()):
            yield key, self._objects[key]

    async def _emit(self, res: Res, type_: str, obj: dict, old: dict | None = None) -> None:
        event = {'type': type_, 'object': copy.deepcopy(obj), '_old': old}
        hist = self._history.setdefault(res, [])
        hist.append((int(obj['metadata']['resourceVersion']), event))
        del hist[:-self.history_limit]
        await self._buses[res].put(event)

    def _not_found(self, res: Res, name: str | None) -> ApiError:
        return ApiError(404, 'NotFound', f'{res.plural}.{res.group or "core"} "{name}" not found',
                        {'name': name, 'group': res.group, 'kind': res.plural})

    def _check_scope(self, res: Res, namespace: str | None, writing_named: bool = False) -> None:
        if not self._namespaced(res) and namespace is not None:
            raise ApiError(404, 'NotFound',
                           f'the server could not find the requested resource ({res.plural} is cluster-scoped)')
        if self._namespaced(res) and namespace is None and writing_named:
            raise ApiError(404, 'NotFound',
                           f'the server could not find the requested resource ({res.plural} is namespaced)')

    # ---- request dispatching ----------------------------------------------------------
    def _known(self, res) -> bool:
        if res is None or not res.plural:
            return False
        if res not in self._known_cache:  # kmock's _get_resources() walks everything: remember
            self._known_cache[res] = any(r == res for r in self._get_resources())
        return self._known_cache[res]

    def _unknown_response(self, res) -> rendering.Response:
        e = ApiError(404, 'NotFound', 'the server could not find the requested resource '
                     f'({res.plural}.{res.group or "core"}/{res.version})')
        return rendering.Response(status=404, payload=e.status())

    @staticmethod
    def _header(request: rendering.Request, name: str) -> str | None:
        for k, v in request.headers.items():
            if k.lower() == name.lower():
                return v.split(';')[0].strip()
        return None

    @staticmethod
    def _parse_body(request: rendering.Request) -> Any:
        if isinstance(request.data, (dict, list)):
            return copy.deepcopy(request.data)
        try:
            return json.loads(request.text)
        except ValueError:
            raise ApiError(400, 'BadRequest', 'the request body is not valid JSON') from None

    def _free_cluster_ip(self) -> str:
        network = ipaddress.ip_network(self.service_cidr)
        taken = {(o.raw.get('spec') or {}).get('clusterIP') for _, o in self._of(Res('v1/services')) if not o.deleted}
        while True:  # (the first address is the `kubernetes` Service's)
            ip = str(network[random.randrange(2, network.num_addresses - 1)])
            if ip not in taken:
                return ip

    def _get_or_404(self, res: Res, ns: str | None, name: str) -> dict:
        self._check_scope(res, ns, writing_named=True)
        obj = self._current((res, ns, name))
        if obj is None:
            raise self._not_found(res, name)
        return obj

    def _scale_of(self, res, obj) -> dict:
        spec_p, status_p, sel_p = self._scale_paths.get(res, ('.spec.replicas', '.status.replicas', '.status.selector'))
        m = obj['metadata']
        return {'kind': 'Scale', 'apiVersion': 'autoscaling/v1',
                'metadata': {k: m[k] for k in ('name', 'namespace', 'uid', 'resourceVersion', 'creationTimestamp')
                             if k in m},
                'spec': {'replicas': dig(obj, spec_p) or 0},
                'status': {'replicas': dig(obj, status_p) or 0,
                           **({'selector': dig(obj, sel_p)} if sel_p and dig(obj, sel_p) else {})}}

    # ---- garbage collection -------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg_tasks.add(task)
        task.add_done_callback(self._bg_tasks.discard)
