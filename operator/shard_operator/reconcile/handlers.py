"""The kopf edge: one loop per ShardedModel that runs the reconcile and carries out its Result.

Each ShardedModel gets a kopf daemon that reconciles it whenever something it depends on changes
(the model, its pods, any node: kopf watches wake it) and when its Result says to run again. One
loop per model means one reconcile at a time per model, so nothing needs a lock. The reconcile
(reconcile.py) decides; this module reads the clock, sends the writes, posts the Events through the
recorder, writes the status and sleeps, with the blocking calls in a worker thread. Nodes and the
GPUs pods hold come from kopf indexes.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kopf
from prometheus_client import Histogram

from shard_contract.wire import ShardsResponse

from ..api import GROUP, PLURAL, VERSION
from ..kube import Kube
from ..objects.manifests import MODEL_LABEL, Owner, model_label
from ..settings import Settings
from . import leaders
from .capacity import GpuUse, gpu_use, slim_node
from .core import Event, Memory, Reads, Result, World, failed, reconcile
from .events import event_body, instance
from .timing import retry_after
from .writes import send

log = logging.getLogger("shard_operator")

Recorder = Callable[[dict[str, Any], Event], None]  # (the model's body, the Event)


def stamp() -> str:
    """Now, as a condition's lastTransitionTime."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Loop:
    """One model's running loop: its wake-up call, the spec generation it last reconciled and the
    memory it carries from one reconcile to the next."""

    name: str
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    generation: int = -1
    memory: Memory = field(default_factory=Memory)


class Controller:
    """Settings, the API edge, the recorder and the loop of every model."""

    def __init__(self, settings: Settings, kube: Kube,
                 fetch: Callable[[str, float], ShardsResponse | None] = leaders.fetch,
                 clock: Callable[[], float] = time.monotonic, recorder: Recorder | None = None):
        self.settings, self.kube, self.clock = settings, kube, clock
        self.recorder = recorder or self.post_event
        self.reporter = instance()
        self.reads = Reads(kube, fetch)
        self.loops: dict[tuple[str, str], Loop] = {}  # (namespace, model label) -> its running loop
        self.reconciles = 0
        self.failures = 0
        # Read by the metrics endpoint (metrics.py), with each model's last status.
        self.reconcile_seconds = Histogram("shard_operator_reconcile_seconds", "Time of one reconcile of one model.",
                                           buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=None)

    def post_event(self, body: dict[str, Any], event: Event) -> None:
        """The production recorder: a core/v1 Event about the model (events.py: with an action and
        the reporting controller), and a log line. One that cannot be posted is logged, never fatal."""
        meta = body["metadata"]
        log.info("%s/%s %s: %s", meta.get("namespace"), meta["name"], event.reason, event.message)
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            self.kube.event(event_body(body, event.type, event.reason, event.message, now, self.reporter))
        except Exception as err:  # noqa: BLE001 -- events are for people: a lost one must not fail the reconcile
            log.warning("event %s about %s not posted: %s", event.reason, meta["name"], err)

    def statuses(self) -> dict[tuple[str, str], dict[str, Any]]:
        """(namespace, name) -> the status each running model loop last wrote."""
        return {(key[0], loop.name): loop.memory.status for key, loop in list(self.loops.items())
                if loop.memory.status is not None}

    # ---------------------------------------------------------------- waking
    def wake(self, namespace: str, label: str) -> None:
        loop = self.loops.get((namespace, label))
        if loop is not None:
            loop.wake.set()

    def wake_all(self) -> None:
        for loop in list(self.loops.values()):
            loop.wake.set()

    def wake_for_spec(self, namespace: str, name: str, generation: int | None) -> None:
        """Our own status writes are model events too: only a new spec needs a reconcile."""
        loop = self.loops.get((namespace, model_label(name)))
        if loop is not None and loop.generation != generation:
            loop.wake.set()

    async def run(self, body: kopf.Body, stopped: kopf.DaemonStopped, world: Callable[[], World]) -> None:
        """A model's loop: reconcile, then sleep until woken or due."""
        namespace = body.metadata.namespace
        assert namespace is not None, "a ShardedModel is namespaced"
        key = (namespace, model_label(body.metadata.name))
        loop = self.loops[key] = Loop(body.metadata.name)
        try:
            while not stopped:
                loop.wake.clear()
                snapshot = copy.deepcopy({"metadata": dict(body.metadata), "spec": dict(body.spec),
                                          "status": dict(body.status)})
                with self.reconcile_seconds.time():
                    wait = await asyncio.to_thread(self.step, loop, snapshot, world())
                try:  # kopf cancels this task when the model is deleted or the operator stops
                    await asyncio.wait_for(loop.wake.wait(), timeout=wait)
                except TimeoutError:
                    pass
                if loop.wake.is_set() and not stopped:
                    await asyncio.sleep(self.settings.debounce_seconds)  # one reconcile for a burst of events
        finally:
            if self.loops.get(key) is loop:
                del self.loops[key]

    # ---------------------------------------------------------------- one round
    def step(self, loop: Loop, body: dict[str, Any], world: World) -> float:
        """Reconcile the model and carry out the Result: writes, Events, then the status. Returns the
        seconds until the next round is due. Nothing raises out of here: a failure is reported, and
        the next round, soon, does what is still missing."""
        self.reconciles += 1
        owner = Owner.of(body)
        loop.generation = body["metadata"].get("generation") or 0
        result, writing_status = None, False
        try:
            result = reconcile(body, world, loop.memory, self.clock(), stamp(), self.settings, self.reads)
            loop.memory = result.memory  # the settle window counts whatever becomes of the writes
            send(self.kube, result.writes)
            self._post(body, result.events)
            writing_status = True
            self._write_status(owner, loop, result)
            return result.requeue_after
        except Exception as err:  # nothing must end the loop: say why, and the next round retries
            self.failures += 1
            log.exception("reconcile of %s/%s failed", owner.namespace, owner.name)
            if writing_status:  # it failed, maybe after it landed
                loop.memory = dataclasses.replace(loop.memory, status_unknown=True)
            wait = retry_after(self.settings.resync_seconds, result.requeue_after if result else None)
            self._report_failure(loop, body, err, wait)
            return wait

    def _report_failure(self, loop: Loop, body: dict[str, Any], err: Exception, wait: float) -> None:
        """The Degraded condition (ReconcileError) and a Warning Event say what went wrong."""
        try:
            report = failed(body, loop.memory, err, stamp(), wait)
            self._write_status(Owner.of(body), loop, report)
        except Exception:  # the API may be what failed: the next round tries again
            log.exception("reporting the failed reconcile of %s/%s failed too", body["metadata"].get("namespace"),
                          body["metadata"]["name"])
            loop.memory = dataclasses.replace(loop.memory, status_unknown=True)
            return
        self._post(body, report.events)

    def _write_status(self, owner: Owner, loop: Loop, result: Result) -> None:
        """Send the Result's status write. One that fails may have landed: until a write is answered
        the server's status is unknown, and the next write sends all of it (`Memory.patch_for`)."""
        if result.status_patch is not None:
            self.kube.patch_status(owner.namespace, owner.name, result.status_patch)
        loop.memory = dataclasses.replace(loop.memory, status=result.status, status_unknown=False)

    def _post(self, body: dict[str, Any], events: list[Event]) -> None:
        for event in events:
            self.recorder(body, event)


# ---------------------------------------------------------------- kopf wiring
def build_registry(controller: Controller, login: Callable[..., Any] | None = None) -> kopf.OperatorRegistry:
    """The kopf handlers of one operator instance (tests build several, one after another)."""
    registry = kopf.OperatorRegistry()
    if login is not None:
        kopf.on.login(registry=registry)(login)
    else:
        kopf.on.login(registry=registry)(kopf.login_via_client)

    @kopf.index("", "v1", "nodes", id="nodes_index", registry=registry)
    def nodes_index(body: kopf.Body, **_: Any) -> dict[None, dict[str, Any]]:
        return {None: slim_node(dict(body))}

    @kopf.index("", "v1", "pods", id="gpu_index", registry=registry)
    def gpu_index(body: kopf.Body, labels: kopf.Labels, **_: Any) -> dict[None, GpuUse] | None:
        use = gpu_use(dict(body), labels.get(MODEL_LABEL, ""))
        return {None: use} if use is not None else None

    @kopf.on.event("", "v1", "nodes", registry=registry)
    def node_changed(**_: Any) -> None:
        controller.wake_all()

    @kopf.on.event("", "v1", "pods", labels={MODEL_LABEL: kopf.PRESENT}, registry=registry)
    def pod_changed(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
        if namespace is not None:  # pods are namespaced; kopf's types allow cluster-scoped objects
            controller.wake(namespace, labels[MODEL_LABEL])

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def model_changed(namespace: str | None, name: str, meta: kopf.Meta, **_: Any) -> None:
        if namespace is not None:
            controller.wake_for_spec(namespace, name, meta.get("generation"))

    # kopf passes the indexes by their names, which its DaemonFn protocol does not list.
    @kopf.daemon(GROUP, VERSION, PLURAL, id="model_loop", registry=registry,  # type: ignore[arg-type]
                 cancellation_timeout=10.0)
    async def model_loop(body: kopf.Body, stopped: kopf.DaemonStopped, nodes_index: kopf.Index,
                         gpu_index: kopf.Index, **_: Any) -> None:
        def world() -> World:  # index values are replaced, never changed in place: no copies
            return World(nodes=list(nodes_index.get(None, [])), gpu_uses=list(gpu_index.get(None, [])))
        await controller.run(body, stopped, world)

    return registry


def kopf_settings(settings: Settings) -> kopf.OperatorSettings:
    ks = kopf.OperatorSettings()
    # Our Events go through the recorder (Controller.post_event, events.py): kopf's own would carry
    # no action, and its per-handler log lines would be writes on every reconcile.
    ks.posting.enabled = False
    ks.peering.standalone = settings.standalone
    ks.watching.server_timeout = 300
    ks.persistence.finalizer = "sharding.dev/operator"
    return ks
