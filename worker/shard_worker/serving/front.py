"""`python -m shard_worker.serving.front`: the leader's HTTP server, in a process of its own.

The leader's engine process (`rank/lifecycle.py`) starts it with one end of a socket pair
(`ipc.FD_ENV`) and the rank's environment. It serves everything the leader serves (the probes,
`/v1/shards`, `/metrics`, the OpenAI routes, the dashboard) with the same app and routes as a rank
that serves in its own process, but its `Probes`, `Link` and `Outcomes` are the engine process
across the pipe (`remote.EngineClient`). So the per-chunk work of a stream (detokenizing, stop
strings, JSON, server-sent events, the HTTP sends), like tokenizing before it (`textproc.py`,
its children), never takes the engine process's GIL. It imports no torch.

It dies with the engine process (the kernel kills it when its parent exits, and it stops when the
pipe ends), and the engine process stops the rank when this one exits. SIGTERM / SIGINT stop it
gracefully: in-flight requests get `GRACEFUL_SECONDS` while the engine process serves them on.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import uvicorn

from shard_contract.env import EXIT_CONFIG, HOST_ENV, WorkerEnv
from shard_contract.plan import Plan

from ..log import first_line, log
from .app import build_app
from .ipc import FD_ENV
from .limits import BoundedBodies, server_limits
from .remote import EngineClient
from .routes import OpenAIRoutes

GRACEFUL_SECONDS = 10  # in-flight requests get this long to finish on SIGTERM


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills it when the thread that started it ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def spawn(sock: socket.socket, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start the HTTP process with `sock` as its end of the pipe. Call it from the main thread
    (the kernel kills the child when the thread that started it exits)."""
    child_env = {**(env if env is not None else os.environ), FD_ENV: str(sock.fileno())}
    return subprocess.Popen([sys.executable, "-m", __name__], env=child_env, pass_fds=(sock.fileno(),),
                            stdin=subprocess.DEVNULL,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)


def _title(env: WorkerEnv) -> None:
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(f"shard-worker-http model={env.model_name} group={env.replica} rank={env.rank} port={env.port}")


async def serve(env: WorkerEnv, plan: Plan, sock: socket.socket) -> int:
    client = EngineClient(env.rank)
    await client.connect(sock)
    try:
        api = OpenAIRoutes(env.model_name, env.model_dir, plan.max_model_len, env.api_key_file, client.ready_link,
                           client, text_timeout=env.text_timeout)
    except Exception as err:  # noqa: BLE001 -- an unreadable tokenizer or API key
        log(env.rank, f"cannot serve: {first_line(err)}")
        return EXIT_CONFIG
    app = BoundedBodies(build_app(env.model_name, client, api), env.max_body_bytes, env.read_timeout)
    config = uvicorn.Config(app, host=os.environ.get(HOST_ENV, "0.0.0.0"), port=env.port, log_level="warning",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=GRACEFUL_SECONDS,
                            **server_limits(env.read_timeout))
    server = uvicorn.Server(config)
    client.on_gone = lambda: setattr(server, "should_exit", True)
    try:
        await server.serve()
    except SystemExit as err:  # uvicorn could not bind the port
        return int(err.code or 1)
    return 1 if client.gone and not server.started else 0


def main() -> int:
    env = WorkerEnv.from_env()
    plan = Plan.from_json(Path(env.plan_file).read_text())
    sock = socket.socket(fileno=int(os.environ[FD_ENV]))
    _title(env)
    # uvicorn re-raises the signal that stopped it once it has shut down: handlers of our own let
    # the process end here instead.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    return asyncio.run(serve(env, plan, sock))


if __name__ == "__main__":
    sys.exit(main())
