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
import base64
import copy
import datetime
import ipaddress
import json
import random
import re
import string
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import enums, parsing, rendering

from . import tables, validation
from .patches import merge_patch, strategic_merge_patch
from .schemas import OPENAPI_V2, OPENAPI_V2_TYPE, openapi_v3, structural
from .tables import dig

Res = kmock.resource

# kmock reads ".../namespaces/X" as namespace X's scope, so a request on the Namespace resource
# itself (/api/v1/namespaces[/X[/status|finalize]]) parses with no resource, or fails. kmock 0.8 has
# no hook for its URL parsing: `__call__` (its entry point) reads these requests itself.
NAMESPACE_PATH = re.compile(r'/api/v1/namespaces(?:/([^/]+)(?:/(status|finalize))?)?/?')
Key = tuple  # (resource, namespace|None, name)
STREAMS = ('portforward', 'exec', 'attach')  # pods' streaming subresources
PODS, NODES = Res('v1/pods'), Res('v1/nodes')
KUBERNETES_VERSION = 'v1.33.0'


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict:
        return {'kind': 'Status', 'apiVersion': 'v1', 'metadata': {}, 'status': 'Failure',
                'message': self.message, 'reason': self.reason, 'details': self.details, 'code': self.code}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%dT%H:%M:%SZ')


SECRET_KEY = re.compile(r'^[-._a-zA-Z0-9]+$')


def secret_write(old: dict | None, new: dict) -> dict:
    """A Secret as the API server stores it: `stringData` merged into `data` (base64) and dropped,
    `type` Opaque by default and then fixed, every `data` value valid base64 under a valid key, and
    nothing of an `immutable` Secret changed (kube-apiserver's Secret strategy and validation)."""
    new = copy.deepcopy(new)
    data = dict(new.get('data') or {})
    for key, value in (new.pop('stringData', None) or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    for key, value in data.items():
        if not SECRET_KEY.match(key):
            raise ApiError(422, 'Invalid', f'Secret "{new["metadata"].get("name")}" is invalid: data[{key}]: Invalid '
                           f'value: "{key}": a valid config key must consist of alphanumeric characters, \'-\', '
                           '\'_\' or \'.\'')
        try:
            base64.b64decode(value, validate=True)
        except (ValueError, TypeError):
            raise ApiError(400, 'BadRequest', 'Secret in version "v1" cannot be handled as a Secret: illegal '
                           'base64 data') from None
    if data:
        new['data'] = data
    new['type'] = new.get('type') or (old or {}).get('type') or 'Opaque'
    if old is not None:
        problems = ([f'type: Invalid value: "{new["type"]}": field is immutable'] if new['type'] != old.get('type')
                    else [])
        if old.get('immutable'):
            problems += [f'{f}: Forbidden: field is immutable when `immutable` is set'
                         for f in ('data', 'immutable') if new.get(f) != old.get(f)]
        if problems:
            raise ApiError(422, 'Invalid', f'Secret "{old["metadata"]["name"]}" is invalid: ' + ', '.join(problems))
    return new


# --- selectors -------------------------------------------------------------------------

def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, ''
    for ch in s:
        if ch == ',' and depth == 0:
            parts.append(cur)
            cur = ''
            continue
        depth += ch == '('
        depth -= ch == ')'
        cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def parse_label_selector(sel: str | None):
    if not sel:
        return lambda labels: True
    reqs: list[tuple[str, str, Any]] = []
    for term in _split_top(sel):
        if m := re.fullmatch(r'([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)', term):
            key, op, vals = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(',') if v.strip()}
            reqs.append((key, op, vals))
        elif m := re.fullmatch(r'([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)', term):
            reqs.append((m.group(1), {'=': 'eq', '==': 'eq', '!=': 'ne'}[m.group(2)], m.group(3)))
        elif m := re.fullmatch(r'!\s*([\w./-]+)', term):
            reqs.append((m.group(1), 'absent', None))
        elif re.fullmatch(r'[\w./-]+', term):
            reqs.append((term, 'exists', None))
        else:
            raise ApiError(400, 'BadRequest', f'unable to parse requirement: {term!r}')

    def check(labels: dict) -> bool:
        for key, op, val in reqs:
            present, v = key in labels, labels.get(key)
            failed = ((op == 'eq' and v != val) or (op == 'ne' and present and v == val)
                      or (op == 'in' and (not present or v not in val)) or (op == 'notin' and present and v in val)
                      or (op == 'exists' and not present) or (op == 'absent' and present))
            if failed:
                return False
        return True
    return check


def parse_field_selector(sel: str | None):
    if not sel:
        return lambda obj: True
    reqs = []
    for term in _split_top(sel):
        m = re.fullmatch(r'([\w.]+)\s*(==|=|!=)\s*(.*)', term)
        if not m:
            raise ApiError(400, 'BadRequest', f'invalid field selector: {term!r}')
        reqs.append((m.group(1), m.group(2) != '!=', m.group(3)))

    def check(obj: dict) -> bool:
        for path, positive, val in reqs:
            actual = dig(obj, path)
            actual = '' if actual is None else str(actual).lower() if isinstance(actual, bool) else str(actual)
            if (actual == val) != positive:
                return False
        return True
    return check


# --- pods ------------------------------------------------------------------------------

def in_seconds(seconds: float) -> str:
    return (datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)).strftime('%Y-%m-%dT%H:%M:%SZ')


def deletion_grace(pod: dict, asked: Any) -> int | None:
    """The grace period of a pod's deletion (kube-apiserver's pod strategy, CheckGracefulDelete):
    the one asked for, else spec.terminationGracePeriodSeconds (30 by default); 0 for a pod that
    no kubelet runs (unscheduled, or Succeeded/Failed). None: a graceful deletion is pending with a
    period no longer than that, and this one changes nothing."""
    spec, status, meta = pod.get('spec') or {}, pod.get('status') or {}, pod['metadata']
    grace = int(asked) if asked is not None else int(spec.get('terminationGracePeriodSeconds', 30))
    if not spec.get('nodeName') or status.get('phase') in ('Succeeded', 'Failed'):
        grace = 0
    pending = meta.get('deletionGracePeriodSeconds')
    if meta.get('deletionTimestamp') and pending is not None and grace >= pending:
        return None
    return max(grace, 0)


# What an update may change in a pod's spec (kube-apiserver's ValidatePodUpdate): images, the
# activeDeadlineSeconds, added tolerations and removed scheduling gates. Binding goes through
# pods/binding.
def pod_update(old: dict, new: dict) -> None:
    def mutable_cleared(spec: dict) -> dict:
        spec = copy.deepcopy(spec or {})
        for key in ('containers', 'initContainers'):
            for container in spec.get(key) or []:
                container.pop('image', None)
        for key in ('activeDeadlineSeconds', 'tolerations', 'schedulingGates'):
            spec.pop(key, None)
        return spec
    old_spec, new_spec = old.get('spec') or {}, new.get('spec') or {}
    kept = all(t in (new_spec.get('tolerations') or []) for t in old_spec.get('tolerations') or [])
    if mutable_cleared(old_spec) != mutable_cleared(new_spec) or not kept:
        raise ApiError(422, 'Invalid',
                       f'Pod "{old["metadata"]["name"]}" is invalid: spec: Forbidden: pod updates may not '
                       'change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,'
                       '`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),'
                       '`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)')


# --- admission ----------------------------------------------------------------------------

@attrs.define
class Admission:
    """What one HTTP write asks the server to check (`fieldValidation`: Ignore, Warn (the default
    since v1.27) or Strict), and the warnings it gets back (`Warning: 299 - "..."` headers)."""

    field_validation: str = 'Warn'
    warnings: list = attrs.field(factory=list)

    @classmethod
    def of(cls, params) -> 'Admission':
        directive = params.get('fieldValidation') or 'Warn'
        if directive not in ('Ignore', 'Warn', 'Strict'):
            raise ApiError(400, 'BadRequest',
                           f'fieldValidation parameter unsupported: "{directive}": supported values: '
                           '"Ignore", "Strict", "Warn"')
        return cls(directive)


# --- fault injection ---------------------------------------------------------------------

@attrs.define(kw_only=True)
class Faults:
    """What a real kube-apiserver does to its clients under load or across a restart, injected into
    a fraction of the HTTP requests on resources (discovery and the in-process API are spared, so a
    test arranges and reads its world reliably). Draws are seeded (requests and watch streams each
    from their own sequence): the same requests in the same order get the same faults, though
    threads and timing may order them differently from one run to the next.

    * error: 500 InternalError, nothing applied, as when etcd times out ("etcdserver: request timed
      out") or an admission webhook fails.
    * conflict: 409 Conflict on an update (PATCH, PUT), nothing applied, as when another writer
      changed the object first and the server's own retries of a contended object give up.
    * timeout: applied, then 504 Timeout after `delay` s, as the server's --request-timeout filter
      answers while the write still lands in etcd: the client cannot tell whether it happened.
    * slow: applied and answered after `delay` s, as an overloaded server (or etcd) does; a client
      whose timeout is shorter gives up on a request that took effect.
    * drop_watch: every `watch_life` s, each open watch stream is cut with this probability (its
      connection closed mid-stream, without a last event), as when the server restarts or a load
      balancer drops the connection; the client must watch again from its last resourceVersion.

    `paths` (a regular expression) aims the request faults at the requests whose URL path it
    matches, as a failing webhook or etcd member hits some resources only.
    """

    seed: int = 0
    error: float = 0.0
    conflict: float = 0.0
    timeout: float = 0.0
    slow: float = 0.0
    drop_watch: float = 0.0
    delay: float = 1.0
    watch_life: float = 1.0
    paths: str = ''
    injected: dict = attrs.field(factory=dict, repr=False)  # fault -> how many times, for tests and people
    _requests: random.Random = attrs.field(init=False, repr=False)
    _watches: random.Random = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._requests, self._watches = random.Random(self.seed), random.Random(self.seed + 1)

    @classmethod
    def parse(cls, text: str) -> 'Faults':
        """'error=0.05,conflict=0.05,drop_watch=0.2,seed=1': the numeric fields by name."""
        names = [f.name for f in attrs.fields(cls) if f.init and f.name not in ('injected', 'paths')]
        values = {}
        for part in filter(None, (p.strip() for p in text.split(','))):
            name, _, value = part.partition('=')
            if name not in names:
                raise ValueError(f'unknown fault {name!r}: expected one of {", ".join(names)}')
            try:
                values[name] = int(value) if name == 'seed' else float(value)  # (their fields' types)
            except ValueError:
                raise ValueError(f'{name}={value!r}: expected a number') from None
        return cls(**values)  # type: ignore[arg-type]

    def _count(self, fault: str) -> str:
        self.injected[fault] = self.injected.get(fault, 0) + 1
        return fault

    def draw(self, method: str, path: str, watch: bool) -> str | None:
        """The fault this request gets, if any (a watch request can only fail to start)."""
        if self.paths and not re.search(self.paths, path):
            return None
        eligible = [('error', self.error), ('conflict', self.conflict if method in ('PATCH', 'PUT') else 0.0),
                    ('timeout', 0.0 if watch else self.timeout), ('slow', 0.0 if watch else self.slow)]
        u = self._requests.random()
        for fault, rate in eligible:
            if u < rate:
                return self._count(fault)
            u -= rate
        return None

    def cut(self) -> bool:
        """Whether an open watch stream is cut now (asked every `watch_life` s)."""
        if self._watches.random() >= self.drop_watch:
            return False
        self._count('drop_watch')
        return True


# --- the emulator ----------------------------------------------------------------------

@attrs.define(kw_only=True)
class FidelityEmulator(kmock.KubernetesEmulator):
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

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.load_builtin_resources:
            self.resources.load_bundled()
        self.fallback[enums.method.PUT] << self._serve_result
        self.fallback[enums.method.DELETE] << self._serve_result  # deletecollection (no name)
        self.fallback['get /openapi/v2'] << self._serve_openapi_v2
        self.fallback['get /openapi/v3'] << self._serve_openapi_v3_root
        self.fallback['get', re.compile(r'/openapi/v3/apis?/.+')] << self._serve_openapi_v3_gv

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

    # Fallback reactions registered by the base class for writes.
    async def _serve_result(self, request):
        # _handle() answers every method on known resources itself; this is what is left.
        if not self._known(request.resource):
            return self._unknown_response(request.resource)
        return rendering.Response(status=405, payload=ApiError(405, 'MethodNotAllowed', 'method not allowed').status())

    _serve_create = _serve_update = _serve_delete = _serve_result

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
        if res == Res('v1/secrets'):
            body = secret_write(None, body)
            meta = body['metadata']
        if res in self._schemas:
            unknown: list[str] = []
            body = structural(self._schemas[res], body, unknown)
            meta = body['metadata']
            self._admit(res, body, None, None, unknown, admit)
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
        return copy.deepcopy(body)

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
        if res == Res('v1/secrets'):
            new = secret_write(old, new)
            nm = new['metadata']
        if res in self._schemas:
            unknown: list[str] = []
            new = structural(self._schemas[res], new, unknown)
            nm = new['metadata']
            self._admit(res, new, old, sub, unknown, admit)
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

    def _scale_of(self, res, obj) -> dict:
        spec_p, status_p, sel_p = self._scale_paths.get(res, ('.spec.replicas', '.status.replicas', '.status.selector'))
        m = obj['metadata']
        return {'kind': 'Scale', 'apiVersion': 'autoscaling/v1',
                'metadata': {k: m[k] for k in ('name', 'namespace', 'uid', 'resourceVersion', 'creationTimestamp')
                             if k in m},
                'spec': {'replicas': dig(obj, spec_p) or 0},
                'status': {'replicas': dig(obj, status_p) or 0,
                           **({'selector': dig(obj, sel_p)} if sel_p and dig(obj, sel_p) else {})}}

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

    # ---- garbage collection -------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg_tasks.add(task)
        task.add_done_callback(self._bg_tasks.discard)

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

    # ---- reads ----------------------------------------------------------------------------
    def _visible(self, request, obj: dict, lcheck, fcheck) -> bool:
        meta = obj.get('metadata', {})
        return ((request.namespace is None or meta.get('namespace') == request.namespace)
                and lcheck(meta.get('labels') or {}) and fcheck(obj))

    def _wants_table(self, request) -> bool:
        return 'as=Table' in (self._raw_accept(request) or '')

    @staticmethod
    def _raw_accept(request) -> str | None:
        for k, v in request.headers.items():
            if k.lower() == 'accept':
                return v
        return None

    def _table(self, request, res: Res, objs: list[dict], definitions: bool = True) -> dict:
        columns = (tables.custom_columns(self._printer_columns.get(res, [])) if res in self._custom
                   else tables.BUILTIN.get(f'{self._api_version(res)}/{res.plural}', tables.DEFAULT))
        return tables.table(columns, objs, str(self._rv),
                            include_object=request.params.get('includeObject') or 'Metadata',
                            definitions=definitions)

    async def _serve_fetch(self, request):
        res, ns, name, sub = request.resource, request.namespace, request.name, request.subresource
        if not self._known(res):
            return self._unknown_response(res)
        try:
            if res == PODS and (sub or '').split('/')[0] == 'proxy':
                return await self._pod_proxy(request, ns, name, sub.partition('/')[2])
            async with self._lock:
                obj = self._get_or_404(res, ns, name)
            if sub == 'scale':
                if not self._has_sub(res, 'scale'):
                    raise self._not_found(res, f'{name}/scale')
                return rendering.Response(status=200, payload=self._scale_of(res, obj))
            if sub == 'log' and res == PODS:
                return await self._pod_log(request, obj)
            if sub not in (None, 'status'):
                raise self._not_found(res, f'{name}/{sub}')
        except ApiError as e:
            return rendering.Response(status=e.code, payload=e.status())
        # NB: always return an explicit status: kmock's Response._render() stores the status of a
        # returned Response on the (shared) fallback reaction, so it would leak into later requests.
        return rendering.Response(status=200,
                                  payload=self._table(request, res, [obj]) if self._wants_table(request) else obj)

    async def _pod_log(self, request, pod: dict) -> rendering.Response:
        """pods/log, as kube-apiserver serves it: from the kubelet of the pod's node, at the
        address and port the Node's status names (addresses, daemonEndpoints.kubeletEndpoint),
        over HTTPS without checking the kubelet's certificate (the apiserver's default without
        --kubelet-certificate-authority); the answer is streamed through (`-f` follows)."""
        meta, spec = pod['metadata'], pod.get('spec') or {}
        containers = [c['name'] for c in spec.get('containers') or []]
        container = request.params.get('container') or (containers[0] if len(containers) == 1 else None)
        if container is None:
            raise ApiError(400, 'BadRequest', f'a container name must be specified for pod {meta["name"]}, '
                           f'choose one of: [{" ".join(containers)}]')
        if container not in containers:
            raise ApiError(400, 'BadRequest', f'container {container} is not valid for pod {meta["name"]}')
        async with self._lock:
            node = self._current((NODES, None, spec['nodeName'])) if spec.get('nodeName') else None
        if node is None:
            raise ApiError(400, 'BadRequest', f'pod {meta["name"]} does not have a host assigned')
        status = node.get('status') or {}
        port = dig(status, 'daemonEndpoints.kubeletEndpoint.Port')
        address = next((a['address'] for kind in ('Hostname', 'InternalIP', 'ExternalIP')
                        for a in status.get('addresses') or [] if a.get('type') == kind), None)
        if not port or not address:
            raise ApiError(500, 'InternalError', f'no kubelet endpoint for node {node["metadata"]["name"]}')
        query = {k: v for k, v in request.params.items() if k in ('follow', 'tailLines', 'limitBytes', 'timestamps',
                                                                    'previous', 'sinceSeconds')}
        url = f'https://{address}:{port}/containerLogs/{meta["namespace"]}/{meta["name"]}/{container}'
        session = aiohttp.ClientSession()
        try:
            upstream = await session.get(url, params=query, ssl=False)
        except aiohttp.ClientError as err:
            await session.close()
            raise ApiError(500, 'InternalError', f'Get "{url}": {err}') from err

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.content.iter_any():
                    yield chunk
            finally:
                upstream.release()
                await session.close()
        return rendering.Response(status=upstream.status, headers={'Content-Type': 'text/plain'}, payload=body())

    async def _pod_proxy(self, request, ns: str, target: str, path: str) -> rendering.Response:
        """GET pods/[scheme:]NAME[:PORT]/proxy/PATH, as kube-apiserver serves it (the pod registry's
        ResourceLocation, then apimachinery's proxy transport): to the pod's IP at PORT (none: its
        first declared container port), the query passed on, the pod's answer returned with its
        status code and body; 404 for an unknown pod, 400 "address not allowed" while the pod has no
        IP, 503 "error trying to reach service: ..." when nothing answers there."""
        parts = target.split(':')
        if len(parts) > 3:
            raise ApiError(400, 'BadRequest', f'invalid pod request "{target}"')
        scheme, name, port = {1: ['http', *parts, ''], 2: ['http', *parts], 3: parts}[len(parts)]
        async with self._lock:
            pod = self._get_or_404(PODS, ns, name)
        if not port:
            port = next((str(p['containerPort']) for c in (pod.get('spec') or {}).get('containers') or []
                         for p in c.get('ports') or []), '')
        ip = (pod.get('status') or {}).get('podIP')
        if not ip:
            raise ApiError(400, 'BadRequest', 'address not allowed')
        host = f'{ip}:{port}' if port else ip
        url = f'{scheme}://{self.pod_address(ip)}{":" + port if port else ""}/{path}'
        try:
            async with aiohttp.ClientSession() as session, session.get(
                    url, params=request.params, ssl=False, allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=30)) as upstream:
                body = await upstream.read()
        except (TimeoutError, aiohttp.ClientError, ValueError) as err:
            raise ApiError(503, 'ServiceUnavailable', f'error trying to reach service: dial tcp {host}: {err}') from err
        return rendering.Response(status=upstream.status, payload=body,
                                  headers={'Content-Type': upstream.headers.get('Content-Type', 'text/plain')})

    async def _serve_list(self, request):
        res = request.resource
        if not self._known(res):
            return self._unknown_response(res)
        try:
            self._check_scope(res, request.namespace)
            lcheck = parse_label_selector(request.params.get('labelSelector'))
            fcheck = parse_field_selector(request.params.get('fieldSelector'))
        except ApiError as e:
            return rendering.Response(status=e.code, payload=e.status())
        async with self._lock:  # select, then copy: copying every object of a big list is slow
            objs = [copy.deepcopy(o.raw) for _, o in self._of(res)
                    if not o.deleted and self._visible(request, o.raw, lcheck, fcheck)]
            rv = str(self._rv)
        objs = sorted(objs, key=lambda o: (o['metadata'].get('namespace') or '', o['metadata']['name']))
        offset = int(base64.b64decode(request.params['continue']).decode()) if request.params.get('continue') else 0
        limit = int(request.params.get('limit') or 0)
        page = objs[offset:offset + limit] if limit else objs[offset:]
        cont = base64.b64encode(str(offset + limit).encode()).decode() if limit and offset + limit < len(objs) else ''
        if self._wants_table(request):
            return rendering.Response(status=200, payload=self._table(request, res, page))
        return rendering.Response(status=200, payload={
            'kind': f'{self._kind(res)}List', 'apiVersion': self._api_version(res),
            'metadata': {'resourceVersion': rv, **({'continue': cont} if cont else {})}, 'items': page})

    async def _serve_watch(self, request):  # type: ignore[override]  # a Response, not kmock's stream
        if not self._known(request.resource):
            return self._unknown_response(request.resource)
        try:
            self._check_scope(request.resource, request.namespace)
            lcheck = parse_label_selector(request.params.get('labelSelector'))
            fcheck = parse_field_selector(request.params.get('fieldSelector'))
        except ApiError as e:
            return rendering.Response(status=e.code, payload=e.status())
        if request.name is not None:  # watch on /…/name: same as fieldSelector=metadata.name=…
            by_name = parse_field_selector(f'metadata.name={request.name}')
            fcheck = (lambda f1, f2: lambda o: f1(o) and f2(o))(fcheck, by_name)
        return rendering.Response(status=200, headers={'Content-Type': 'application/json'},
                                  payload=self._watch_stream(request, lcheck, fcheck))

    async def _watch_stream(self, request, lcheck, fcheck) -> AsyncIterator[Any]:
        res = request.resource
        params = request.params
        since = params.get('resourceVersion') or ''
        since = since if since.isdigit() else ''
        bookmarks = params.get('allowWatchBookmarks') == 'true'
        initial_events = params.get('sendInitialEvents') == 'true'
        timeout = float(params['timeoutSeconds']) if params.get('timeoutSeconds') else None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        cut_check = loop.time()  # when injected faults may cut this stream next
        yield b''  # send the headers now

        bus = self._buses[res]
        as_table, first = self._wants_table(request), [True]

        def render(event: dict) -> dict:  # (as a Table: one row each, the columns in the first only)
            if not as_table:
                return event
            table = self._table(request, res, [event['object']], definitions=first[0])
            first[0] = False
            return {'type': event['type'], 'object': table}
        async with self._lock:  # snapshot + subscribe atomically: no lost/duplicated events
            mark = await bus.mark()
            if since in ('', '0') or initial_events:
                replay = [{'type': 'ADDED', 'object': copy.deepcopy(o.raw)}
                          for _, o in self._of(res) if not o.deleted]
            else:
                hist = self._history.get(res, [])
                if hist and int(since) < hist[0][0] - 1 and len(hist) >= self.history_limit:
                    replay = [{'type': 'ERROR', 'object': {'kind': 'Status', 'apiVersion': 'v1', 'status': 'Failure',
                                                           'code': 410, 'reason': 'Expired',
                                                           'message': 'too old resource version'}}]
                else:
                    replay = [ev for rv, ev in hist if rv > int(since)]
            current_rv = str(self._rv)
        try:
            for ev in replay:
                if ev['type'] == 'ERROR':
                    yield ev
                    return
                out = self._filter_event(request, ev, lcheck, fcheck)
                if out:
                    yield render(out)
            if initial_events:
                end = {'resourceVersion': current_rv, 'annotations': {'k8s.io/initial-events-end': 'true'}}
                yield {'type': 'BOOKMARK', 'object': {'kind': self._kind(res), 'apiVersion': self._api_version(res),
                                                      'metadata': end}}
            stream = aiter(bus.stream(since=mark))
            next_bookmark = loop.time() + self.bookmark_interval
            pending: asyncio.Task | None = None
            while True:
                raw = request._raw_request
                transport = getattr(raw, 'transport', None) if raw is not None else None
                faults = self.faults
                if faults is not None and faults.drop_watch and loop.time() >= cut_check:
                    cut_check = loop.time() + faults.watch_life
                    if faults.cut():
                        if transport is not None:
                            transport.abort()  # the connection drops mid-stream: no last chunk
                        return
                if pending is None:
                    pending = asyncio.ensure_future(anext(stream))
                wait = self.watch_poll_interval
                if deadline is not None:
                    wait = min(wait, max(0.0, deadline - loop.time()))
                done, _ = await asyncio.wait([pending], timeout=wait)
                if done:
                    ev, pending = pending.result(), None
                    out = self._filter_event(request, ev, lcheck, fcheck)
                    if out:
                        yield render(out)
                    continue
                if transport is None or transport.is_closing():
                    return  # the client has gone
                if deadline is not None and loop.time() >= deadline:
                    return  # ?timeoutSeconds=
                if bookmarks and loop.time() >= next_bookmark:
                    next_bookmark = loop.time() + self.bookmark_interval
                    yield {'type': 'BOOKMARK', 'object': {'kind': self._kind(res), 'apiVersion': self._api_version(res),
                                                          'metadata': {'resourceVersion': str(self._rv)}}}
        finally:
            if pending is not None:
                pending.cancel()
            await bus.unmark(mark)

    def _filter_event(self, request, ev: dict, lcheck, fcheck) -> dict | None:
        obj, old = ev['object'], ev.get('_old')
        new_ok = self._visible(request, obj, lcheck, fcheck)
        if ev['type'] != 'MODIFIED' or old is None:
            return {'type': ev['type'], 'object': obj} if new_ok else None
        old_ok = self._visible(request, old, lcheck, fcheck)
        if new_ok and old_ok:
            return {'type': 'MODIFIED', 'object': obj}
        if new_ok:
            return {'type': 'ADDED', 'object': obj}
        if old_ok:
            return {'type': 'DELETED', 'object': obj}
        return None

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
