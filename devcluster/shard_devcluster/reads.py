"""The emulated API server's reads: get (with server-side tables for kubectl), pods' log and
proxy, list with selectors and paging, and watch streams (resume, bookmarks, initial events)."""
import asyncio
import base64
import copy
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import attrs
from kmock._internal import rendering

from . import tables
from .apirules import NODES, PODS, ApiError, Res, parse_field_selector, parse_label_selector
from .tables import dig
from .writes import Writes


@attrs.define(kw_only=True)
class Reads(Writes):
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
