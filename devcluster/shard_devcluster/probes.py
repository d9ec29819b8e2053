"""The process kubelet's probes, over HTTP, as a kubelet runs them: the startup probe first, then
readiness (the pod's Ready condition) and liveness side by side.

Startup and readiness decide how soon a pod serves, so they run at most `probe_period` apart;
liveness (a failing rank is killed) keeps the pod's own period: a busy machine must not kill ranks
that a cluster would keep. Not done: exec and tcp probes.
"""

from __future__ import annotations

import asyncio
import signal

import aiohttp

from .kubeletstatus import StatusWriter
from .network import ClusterNetwork, container_port
from .podsetup import Sandbox


class Prober:
    def __init__(self, network: ClusterNetwork, status: StatusWriter, probe_period: float):
        self.network, self.status, self.probe_period = network, status, probe_period
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()

    async def close(self) -> None:
        if self._session:
            await self._session.close()

    async def run(self, sandbox: Sandbox) -> None:
        """The startup probe, then readiness and liveness side by side, as a kubelet runs them."""
        container = sandbox.container
        startup, readiness, liveness = (container.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe"))
        if startup is not None:
            failures = 0
            while not await self._get(sandbox, startup):
                failures += 1
                if failures >= int(startup.get("failureThreshold", 3)):
                    await self._kill_for(sandbox, f"Startup probe failed {failures} times")
                    return
                await asyncio.sleep(self._fast(startup))
                if not sandbox.alive:
                    return
        checks = [self._readiness(sandbox, readiness)]
        if liveness is not None:
            checks.append(self._liveness(sandbox, liveness))
        await asyncio.gather(*checks)

    async def _get(self, sandbox: Sandbox, probe: dict) -> bool:
        http = probe.get("httpGet") or {}
        port = container_port(sandbox.container, http.get("port", 80))
        if port is None:
            return False
        host = self.network.local(http["host"]) if http.get("host") else sandbox.local
        url = f"http://{host}:{port}{http.get('path', '/')}"
        assert self._session is not None
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=probe.get("timeoutSeconds", 1))) as r:
                return 200 <= r.status < 400
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    def _fast(self, probe: dict) -> float:
        """Startup and readiness decide how soon a pod serves: at most `probe_period` apart."""
        return min(float(probe.get("periodSeconds", 10)), self.probe_period)

    async def _readiness(self, sandbox: Sandbox, probe: dict | None) -> None:
        """The pod's Ready condition: at the first success; lost after failureThreshold failures."""
        failures = 0
        while sandbox.alive and not sandbox.deleting:
            ok = probe is None or await self._get(sandbox, probe)
            failures = 0 if ok else failures + 1
            ready = ok or (sandbox.ready and failures < int((probe or {}).get("failureThreshold", 3)))
            if ready != sandbox.ready and sandbox.alive and not sandbox.deleting:
                sandbox.ready = ready
                await self.status.report(sandbox)
            if probe is None:
                return
            await asyncio.sleep(self._fast(probe))

    async def _liveness(self, sandbox: Sandbox, probe: dict) -> None:
        """Kill the container after failureThreshold failures in a row. At the pod's own period: a
        busy machine must not kill ranks that a cluster would keep."""
        failures = 0
        while sandbox.alive:
            await asyncio.sleep(float(probe.get("periodSeconds", 10)))
            failures = 0 if await self._get(sandbox, probe) else failures + 1
            if failures >= int(probe.get("failureThreshold", 3)):
                await self._kill_for(sandbox, f"Liveness probe failed {failures} times")
                return

    @staticmethod
    async def _kill_for(sandbox: Sandbox, reason: str) -> None:
        sandbox.killed_by = reason
        await sandbox.kill(signal.SIGKILL)
