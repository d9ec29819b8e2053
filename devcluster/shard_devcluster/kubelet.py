"""FakeKubelet: makes pods in a FidelityEmulator "run", standing in for the scheduler and kubelets.

* A new pod whose required node (spec.nodeName, or a `metadata.name` node-affinity term) is not a
  Node object stays Pending with PodScheduled=False/Unschedulable, as the scheduler would leave it;
  otherwise it is bound there (spec.nodeName). GPU capacity is not enforced.
* run_processes=False: every other new pod becomes Running and Ready (`ready` decides, per pod).
* run_processes=True (or a predicate of the pod): the first container's command+args runs as a local process ("python" is
  this interpreter; env `value`s and `mounts` honoured: a container path under a mount is mapped
  to the local directory); the pod is Running, then Succeeded/Failed with the exit code. The
  output goes to the emulator's pods/log. Deleting the pod terminates the process.
* fail(): a rank dies (phase Failed, container terminated with an exit code).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import os
import signal
import sys
from typing import Callable

import kmock

PODS = kmock.resource('v1/pods')
NODES = 'v1/nodes'


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')


def required_node(pod: dict) -> str | None:
    spec = pod.get('spec') or {}
    if spec.get('nodeName'):
        return spec['nodeName']
    affinity = ((spec.get('affinity') or {}).get('nodeAffinity') or {}).get('requiredDuringSchedulingIgnoredDuringExecution') or {}
    for term in affinity.get('nodeSelectorTerms') or []:
        for expr in term.get('matchFields') or []:
            if expr.get('key') == 'metadata.name' and expr.get('operator') == 'In' and expr.get('values'):
                return expr['values'][0]
    return None


class FakeKubelet:
    def __init__(self, emu, *, run_processes: bool | Callable[[dict], bool] = False, pod_ip: str = '127.0.0.1',
                 mounts: dict[str, str] | None = None, ready: Callable[[dict], bool] = lambda pod: True,
                 extra_env: dict[str, str] | None = None):
        self.emu = emu
        self.run_processes = run_processes
        self.pod_ip = pod_ip
        self.mounts = dict(mounts or {})
        self.ready = ready
        self.extra_env = dict(extra_env or {})
        self.procs: dict[tuple[str, str], asyncio.subprocess.Process] = {}
        self._tasks: set[asyncio.Task] = set()
        self._main: asyncio.Task | None = None

    async def start(self) -> None:
        bus = self.emu._buses[PODS]
        async with self.emu._lock:  # snapshot + subscribe atomically
            mark = await bus.mark()
            existing = [copy.deepcopy(o.raw) for (r, _, _), o in self.emu.objects.items() if r == PODS and not o.deleted]
        for pod in existing:
            self._spawn(self._on_added(pod))
        self._main = asyncio.create_task(self._loop(bus, mark))

    async def stop(self) -> None:
        if self._main:
            self._main.cancel()
        for t in list(self._tasks):
            t.cancel()
        for proc in list(self.procs.values()):
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def __aenter__(self) -> 'FakeKubelet':
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ---- what tests do to pods -------------------------------------------------------------
    async def fail(self, namespace: str, name: str, exit_code: int = 1, reason: str = 'Error') -> None:
        pod = await self.emu.k8s_get(PODS, namespace, name)
        c = ((pod.get('spec') or {}).get('containers') or [{}])[0]
        await self._set_status(namespace, name, {
            'phase': 'Failed', 'conditions': [{'type': 'Ready', 'status': 'False'}],
            'containerStatuses': [self._cstatus(c, False, {'terminated': {
                'exitCode': exit_code, 'reason': reason, 'finishedAt': _now()}})]})

    async def set_ready(self, namespace: str, name: str, ready: bool) -> None:
        await self._set_status(namespace, name, {'conditions': [{'type': 'Ready', 'status': str(ready)},
                                                                {'type': 'PodScheduled', 'status': 'True'}]})

    # ---- internals ---------------------------------------------------------------------------
    @staticmethod
    def _cstatus(c: dict, ready: bool, state: dict) -> dict:
        # The kubernetes client validates V1ContainerStatus: name, image, imageID, ready and
        # restartCount are required, or listing pods fails.
        image = c.get('image') or 'local'
        return {'name': c.get('name', 'c'), 'image': image, 'imageID': 'fake://' + image,
                'ready': ready, 'started': ready, 'restartCount': 0, 'state': state}

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _loop(self, bus, mark) -> None:
        async for ev in bus.stream(since=mark):
            pod = ev['object']
            meta = pod['metadata']
            key = (meta.get('namespace'), meta['name'])
            if ev['type'] == 'ADDED':
                self._spawn(self._on_added(pod))
            elif ev['type'] == 'DELETED' or meta.get('deletionTimestamp'):
                proc = self.procs.pop(key, None)
                if proc is not None and proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)

    async def _set_status(self, ns, name, status: dict) -> None:
        try:
            await self.emu.k8s_patch(PODS, ns, name, {'status': status}, subresource='status')
        except Exception:
            pass  # the pod may be gone already

    def _local(self, value: str) -> str:
        for inside, outside in self.mounts.items():
            if value == inside or value.startswith(inside.rstrip('/') + '/'):
                return outside.rstrip('/') + value[len(inside.rstrip('/')):]
        return value

    async def _on_added(self, pod: dict) -> None:
        meta, spec = pod['metadata'], pod.get('spec') or {}
        ns, name = meta.get('namespace'), meta['name']
        if (pod.get('status') or {}).get('phase') in ('Running', 'Succeeded', 'Failed'):
            return
        node = required_node(pod)
        if node is not None and await self.emu.k8s_get(NODES, None, node) is None:
            await self._set_status(ns, name, {'phase': 'Pending', 'conditions': [{
                'type': 'PodScheduled', 'status': 'False', 'reason': 'Unschedulable',
                'message': f'0/1 nodes are available: node {node} does not exist'}]})
            return
        if node is not None and not spec.get('nodeName'):  # the scheduler binds it
            try:
                await self.emu.k8s_patch(PODS, ns, name, {'spec': {'nodeName': node}})
            except Exception:
                return  # gone already
        c = (spec.get('containers') or [{}])[0]
        base = {'hostIP': '10.0.0.1', 'podIP': self.pod_ip, 'startTime': _now()}
        run = self.run_processes(pod) if callable(self.run_processes) else self.run_processes
        if not run:
            ready = bool(self.ready(pod))
            await self._set_status(ns, name, {**base, 'phase': 'Running', 'conditions': [
                {'type': 'PodScheduled', 'status': 'True'}, {'type': 'Ready', 'status': str(ready)},
                {'type': 'ContainersReady', 'status': str(ready)}],
                'containerStatuses': [self._cstatus(c, ready, {'running': {'startedAt': _now()}})]})
            return
        argv = [self._local(a) for a in list(c.get('command') or []) + list(c.get('args') or [])]
        if argv and argv[0] == 'python':
            argv[0] = sys.executable
        env = {**os.environ, **self.extra_env,
               **{e['name']: self._local(str(e.get('value', ''))) for e in c.get('env') or [] if 'name' in e},
               'HOSTNAME': name, 'POD_NAME': name, 'POD_NAMESPACE': ns or ''}
        logs = self.emu.pod_logs.setdefault((ns, name), bytearray())
        try:
            proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=c.get('workingDir') or None,
                                                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        except (OSError, ValueError) as e:
            await self._set_status(ns, name, {**base, 'phase': 'Failed', 'reason': 'StartError', 'message': str(e)})
            return
        self.procs[(ns, name)] = proc
        await self._set_status(ns, name, {**base, 'phase': 'Running', 'conditions': [{'type': 'Ready', 'status': 'True'}],
                                          'containerStatuses': [self._cstatus(c, True, {'running': {'startedAt': _now()}})]})
        while line := await proc.stdout.readline():
            logs += line
        code = await proc.wait()
        self.procs.pop((ns, name), None)
        phase = 'Succeeded' if code == 0 else 'Failed'
        await self._set_status(ns, name, {'phase': phase, 'conditions': [{'type': 'Ready', 'status': 'False'}],
                                          'containerStatuses': [self._cstatus(c, False, {'terminated': {
                                              'exitCode': code, 'reason': 'Completed' if code == 0 else 'Error',
                                              'finishedAt': _now()}})]})
