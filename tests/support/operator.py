"""Run the real operator (kopf + our handlers) against an emulated API server, in its own thread.

kopf gets its own thread and event loop: sharing the test's loop would make its shutdown wait for
the emulator's keep-alive connections. Intervals are settings, so tests poll every few ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import kopf
import kubernetes

from shard_operator.kube import Kube, client_for
from shard_operator.reconcile.handlers import Controller, build_registry, kopf_settings
from shard_operator.settings import Settings

FAST = Settings(resync_seconds=0.5, debounce_seconds=0.01, status_poll_seconds=0.05, poll_timeout_seconds=0.5,
                settle_seconds=0.3, restart_budget=2, host_path_prefix="", health_port=0,
                worker_image="example.com/shard-worker:test")


def fast_settings(**overrides: Any) -> Settings:
    return dataclasses.replace(FAST, **overrides)


@contextlib.asynccontextmanager
async def running_operator(api_url: str, settings: Settings = FAST,
                           fetch: Callable[[str, float], dict | None] | None = None,
                           clock: Callable[[], float] | None = None,
                           kube_type: type[Kube] = Kube) -> AsyncIterator[Controller]:
    """The operator, logged into `api_url`, until the block ends (its API edge a `kube_type`)."""
    kube = kube_type(client_for(kubernetes.client.Configuration(host=api_url)), settings.api_timeout_seconds)
    extra: dict[str, Any] = {"fetch": fetch} if fetch else {}
    if clock is not None:
        extra["clock"] = clock
    controller = Controller(settings, kube, **extra)

    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=api_url, insecure=True)

    registry = build_registry(controller, login=login)
    ks = kopf_settings(settings)
    ks.watching.reconnect_backoff = 0.05
    ks.posting.idle_timeout = 0.2
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(kopf.operator(registry=registry, settings=ks, standalone=True, clusterwide=True,
                                      stop_flag=stop, ready_flag=ready))
        except BaseException as err:  # noqa: BLE001 -- surfaced when the block ends
            errors.append(err)

    thread = threading.Thread(target=main, daemon=True, name="kopf")
    thread.start()
    if not await asyncio.to_thread(ready.wait, 20):
        raise RuntimeError(f"the operator did not start: {errors}")
    try:
        yield controller
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 20)
        kube.core.api_client.close()
    if errors:
        raise errors[0]
    if thread.is_alive():
        raise RuntimeError("the operator did not stop within 20 s")


class ManualClock:
    """A clock that moves only when the test says so (settle windows without sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def eventually(check: Callable[[], Any], timeout: float = 30.0, interval: float = 0.02) -> Any:
    """Await `check()` (sync or async) until it returns something truthy without raising."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: BaseException | None = None
    while True:
        try:
            result = check()
            if asyncio.iscoroutine(result):
                result = await result
            if result:
                return result
            last = None
        except AssertionError as err:
            last = err
        if loop.time() > deadline:
            if last is not None:
                raise last
            raise AssertionError(f"not true within {timeout} s: {getattr(check, '__name__', check)}")
        await asyncio.sleep(interval)
