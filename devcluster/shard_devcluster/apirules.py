"""What the emulated API server decides beside its store, as pure functions and small values:
its errors (`ApiError`), label and field selectors, Secrets' writes, pods' graceful deletion
and the updates their spec allows, admission parameters (dryRun, fieldValidation) and the
injected faults of a server under load (`Faults`). Used by `emulator.py` and its layers."""
import base64
import copy
import datetime
import random
import re
from typing import Any

import attrs
import kmock

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
