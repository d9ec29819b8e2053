"""Fixtures' building blocks: an emulated API server on loopback with our CRD registered, and its
control plane (scheduler, node lifecycle, pod GC, endpoints: controlplane.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import kmock

from shard_operator.api.crd import build_crd

from .controlplane import ControlPlane
from .emulator import FidelityEmulator

SM = 'sharding.dev/v1alpha1/shardedmodels'


@contextlib.asynccontextmanager
async def serve(*, control_plane: bool = True, **options) -> AsyncIterator[tuple[FidelityEmulator, str]]:
    """A FidelityEmulator serving HTTP on 127.0.0.1:<random port>, with the ShardedModel CRD, and
    unless `control_plane=False` the scheduler and controllers with a real cluster's timings."""
    emu = FidelityEmulator(**options)
    async with emu, kmock.Server(emu) as server:
        emu.add_crd(build_crd())
        url = str(server.url).rstrip('/')
        if not control_plane:
            yield emu, url
            return
        async with ControlPlane(emu):
            yield emu, url


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig for kubectl or the operator process, pointing at the emulator."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "test", "user": {}}],
        "contexts": [{"name": "emulator",
                      "context": {"cluster": "emulator", "user": "test", "namespace": "default"}}]}))
    return path
