"""Server-side tables (`Accept: application/json;as=Table;g=meta.k8s.io;v=v1`), as kube-apiserver
prints them for kubectl: the columns of its built-in printers (pkg/printers/internalversion) for
the kinds the dev cluster serves, a custom resource's additionalPrinterColumns, and NAME / CREATED
AT for the rest. Priority 1 columns show with `-o wide`. Pure.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from typing import Any

Cell = Callable[[dict], Any]


def _parse(ts: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(ts.replace('Z', '+00:00'))


def age(ts: str | None) -> str:
    """kubectl's short durations (duration.HumanDuration, abridged): 42s, 5m10s, 3h, 2d."""
    if not ts:
        return '<unknown>'
    secs = max(0, int((datetime.datetime.now(datetime.UTC) - _parse(ts)).total_seconds()))
    if secs < 120:
        return f'{secs}s'
    if secs < 600:
        return f'{secs // 60}m{secs % 60}s' if secs % 60 else f'{secs // 60}m'
    if secs < 3 * 3600:
        return f'{secs // 60}m'
    if secs < 48 * 3600:
        return f'{secs // 3600}h'
    return f'{secs // 86400}d'


def _created(o: dict) -> str:
    return age(o['metadata'].get('creationTimestamp'))


def _name(o: dict) -> str:
    return o['metadata']['name']


def dig(obj: Any, path: str) -> Any:
    """A value at a dotted path (`.status.phase`), None when absent."""
    for part in path.strip('.').split('.'):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


# ---------------------------------------------------------------- pods
def _pod_ready(pod: dict) -> str:
    statuses = (pod.get('status') or {}).get('containerStatuses') or []
    total = len((pod.get('spec') or {}).get('containers') or []) or len(statuses)
    return f"{sum(1 for c in statuses if c.get('ready'))}/{total}"


def _pod_status(pod: dict) -> str:
    status = pod.get('status') or {}
    if pod['metadata'].get('deletionTimestamp'):
        return 'Unknown' if status.get('reason') == 'NodeLost' else 'Terminating'
    if status.get('reason'):  # (Evicted, PortInUse, DeletionByPodGC ...)
        return status['reason']
    for c in status.get('containerStatuses') or []:
        state = c.get('state') or {}
        if (state.get('waiting') or {}).get('reason'):
            return state['waiting']['reason']
        if (state.get('terminated') or {}).get('reason') and status.get('phase') != 'Running':
            return state['terminated']['reason']
    return status.get('phase') or 'Pending'


def _restarts(pod: dict) -> int:
    return sum(c.get('restartCount', 0) for c in (pod.get('status') or {}).get('containerStatuses') or [])


# ---------------------------------------------------------------- nodes
def _node_status(node: dict) -> str:
    conditions = (node.get('status') or {}).get('conditions') or []
    ready: dict[str, Any] = next((c for c in conditions if c.get('type') == 'Ready'), {})
    text = {'True': 'Ready', 'False': 'NotReady'}.get(ready.get('status') or '',
                                                     'NotReady' if not ready else 'Unknown')
    return text + (',SchedulingDisabled' if (node.get('spec') or {}).get('unschedulable') else '')


def _node_roles(node: dict) -> str:
    prefix = 'node-role.kubernetes.io/'
    roles = sorted(k[len(prefix):] for k in (node['metadata'].get('labels') or {}) if k.startswith(prefix))
    return ','.join(roles) or '<none>'


def _node_address(kind: str) -> Cell:
    def cell(node: dict) -> str:
        return next((a['address'] for a in (node.get('status') or {}).get('addresses') or [] if a.get('type') == kind),
                    '<none>')
    return cell


def _node_info(key: str) -> Cell:
    return lambda node: ((node.get('status') or {}).get('nodeInfo') or {}).get(key) or '<unknown>'


# ---------------------------------------------------------------- services and endpoints
def _ports(service: dict) -> str:
    ports = (service.get('spec') or {}).get('ports') or []
    text = ','.join(f"{p['port']}{'' if not p.get('nodePort') else ':' + str(p['nodePort'])}/{p.get('protocol', 'TCP')}"
                    for p in ports)
    return text or '<none>'


def _selector(service: dict) -> str:
    selector = (service.get('spec') or {}).get('selector') or {}
    return ','.join(f'{k}={v}' for k, v in sorted(selector.items())) or '<none>'


def _first_three(items: list[str]) -> str:
    if not items:
        return '<none>'
    more = f' + {len(items) - 3} more...' if len(items) > 3 else ''
    return ','.join(items[:3]) + more


def _endpoints(ep: dict) -> str:
    out = []
    for subset in ep.get('subsets') or []:
        for address in subset.get('addresses') or []:
            out += [f"{address['ip']}:{p['port']}" for p in subset.get('ports') or []] or [address['ip']]
    return _first_three(out)


def _slice_ports(es: dict) -> str:
    ports = es.get('ports') or []
    return ','.join(str(p.get('port', '')) for p in ports) if ports else '<unset>'


def _slice_endpoints(es: dict) -> str:
    return _first_three([a for e in es.get('endpoints') or [] for a in e.get('addresses') or []])


# ---------------------------------------------------------------- events
def _last_seen(event: dict) -> str:
    series = (event.get('series') or {}).get('lastObservedTime')
    return age(series or event.get('lastTimestamp') or event.get('eventTime')
               or event['metadata'].get('creationTimestamp'))


def _regarding(event: dict) -> dict:
    return event.get('involvedObject') or event.get('regarding') or {}


def _event_object(event: dict) -> str:
    ref = _regarding(event)
    return f"{(ref.get('kind') or '').lower()}/{ref.get('name', '')}"


def _event_source(event: dict) -> str:
    source = event.get('source') or {}
    name = source.get('component') or event.get('reportingComponent') or event.get('reportingController') or ''
    return f"{name}, {source['host']}" if source.get('host') else name


_EVENT_COLUMNS = [
    ('Last Seen', _last_seen, 0), ('Type', lambda e: e.get('type', ''), 0),
    ('Reason', lambda e: e.get('reason', ''), 0),
    ('Object', _event_object, 0), ('Subobject', lambda e: _regarding(e).get('fieldPath', ''), 1),
    ('Source', _event_source, 1), ('Message', lambda e: (e.get('message') or e.get('note') or '').strip(), 0),
    ('First Seen', lambda e: age(e.get('firstTimestamp') or e.get('eventTime')), 1),
    ('Count', lambda e: e.get('count') or (e.get('series') or {}).get('count') or 1, 1), ('Name', _name, 1)]


# (column, cell of an object, priority): kube-apiserver's printers for these kinds.
BUILTIN: dict[str, list[tuple[str, Cell, int]]] = {
    'v1/pods': [('Name', _name, 0), ('Ready', _pod_ready, 0), ('Status', _pod_status, 0), ('Restarts', _restarts, 0),
                ('Age', _created, 0), ('IP', lambda p: (p.get('status') or {}).get('podIP') or '<none>', 1),
                ('Node', lambda p: (p.get('spec') or {}).get('nodeName') or '<none>', 1),
                ('Nominated Node', lambda p: (p.get('status') or {}).get('nominatedNodeName') or '<none>', 1),
                ('Readiness Gates', lambda p: '<none>', 1)],
    'v1/nodes': [('Name', _name, 0), ('Status', _node_status, 0), ('Roles', _node_roles, 0), ('Age', _created, 0),
                 ('Version', _node_info('kubeletVersion'), 0), ('Internal-IP', _node_address('InternalIP'), 1),
                 ('External-IP', _node_address('ExternalIP'), 1), ('OS-Image', _node_info('osImage'), 1),
                 ('Kernel-Version', _node_info('kernelVersion'), 1),
                 ('Container-Runtime', _node_info('containerRuntimeVersion'), 1)],
    'v1/services': [('Name', _name, 0), ('Type', lambda s: (s.get('spec') or {}).get('type') or 'ClusterIP', 0),
                    ('Cluster-IP', lambda s: (s.get('spec') or {}).get('clusterIP') or '<none>', 0),
                    ('External-IP', lambda s: ','.join((s.get('spec') or {}).get('externalIPs') or []) or '<none>', 0),
                    ('Port(s)', _ports, 0), ('Age', _created, 0), ('Selector', _selector, 1)],
    'v1/endpoints': [('Name', _name, 0), ('Endpoints', _endpoints, 0), ('Age', _created, 0)],
    'discovery.k8s.io/v1/endpointslices': [
        ('Name', _name, 0), ('AddressType', lambda e: e.get('addressType', ''), 0), ('Ports', _slice_ports, 0),
        ('Endpoints', _slice_endpoints, 0), ('Age', _created, 0)],
    'v1/events': _EVENT_COLUMNS,
    'events.k8s.io/v1/events': _EVENT_COLUMNS,
    'v1/namespaces': [('Name', _name, 0), ('Status', lambda n: (n.get('status') or {}).get('phase') or 'Active', 0),
                      ('Age', _created, 0)],
    'v1/configmaps': [('Name', _name, 0),
                      ('Data', lambda c: len(c.get('data') or {}) + len(c.get('binaryData') or {}), 0),
                      ('Age', _created, 0)],
    'v1/secrets': [('Name', _name, 0), ('Type', lambda s: s.get('type', ''), 0),
                   ('Data', lambda s: len(s.get('data') or {}), 0), ('Age', _created, 0)],
    'coordination.k8s.io/v1/leases': [('Name', _name, 0),
                                      ('Holder', lambda lease: (lease.get('spec') or {}).get('holderIdentity', ''), 0),
                                      ('Age', _created, 0)],
}
DEFAULT: list[tuple[str, Cell, int]] = [('Name', _name, 0),
                                        ('Created At', lambda o: o['metadata'].get('creationTimestamp'), 0)]


def custom_columns(printer_columns: list[dict]) -> list[tuple[str, Cell, int]]:
    """A custom resource's columns: NAME, then its additionalPrinterColumns (AGE when it has none)."""
    if not printer_columns:
        return [('Name', _name, 0), ('Age', _created, 0)]
    cells: list[tuple[str, Cell, int]] = []
    for column in printer_columns:
        path = column['jsonPath']
        if path == '.metadata.creationTimestamp':
            cells.append((column['name'], _created, column.get('priority', 0)))
        else:
            cells.append((column['name'], functools.partial(dig, path=path), column.get('priority', 0)))
    return [('Name', _name, 0), *cells]


def table(columns: list[tuple[str, Cell, int]], objs: list[dict], resource_version: str, *,
          include_object: str = 'Metadata', definitions: bool = True) -> dict:
    """A meta.k8s.io/v1 Table of `objs`. `include_object`: None, Metadata (the default) or Object;
    `definitions`: False in watch events after the first, as the server sends them."""
    def row_object(o: dict) -> dict | None:
        if include_object == 'Object':
            return o
        if include_object == 'None':
            return None
        return {'kind': 'PartialObjectMetadata', 'apiVersion': 'meta.k8s.io/v1', 'metadata': o['metadata']}
    defs = [{'name': name, 'type': 'string', 'format': 'name' if name == 'Name' else '', 'description': name,
             'priority': priority} for name, _, priority in columns]
    return {'kind': 'Table', 'apiVersion': 'meta.k8s.io/v1', 'metadata': {'resourceVersion': resource_version},
            'columnDefinitions': defs if definitions else [],
            'rows': [{'cells': [cell(o) for _, cell, _ in columns], 'object': row_object(o)} for o in objs]}
