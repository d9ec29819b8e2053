"""`python -m shard_worker.launch --local-ranks N`: the N rank processes of one pod.

A pod of the `perTensorGroup` layout holds the GPUs of one tensor-parallel group and runs one rank
per GPU, so NCCL reaches the group's peers over NVLink or PCIe peer-to-peer (CUDA IPC), which it
cannot between pods. The pod's environment is its first rank's (`WorkerEnv`); its i-th rank gets
RANK + i, LOCAL_RANK i (the container sees its GPUs as 0..N-1) and SHARD_PORT + i.

Each rank is `python -m shard_worker`, as in a pod of one rank; the launcher itself imports no
torch. It keeps them as one: when a rank exits with an error or is killed, it stops the others
and exits with that status, so the pod fails and the operator recreates the group, as when a pod
of one rank fails. SIGTERM and SIGINT are passed on to every rank; once all have exited 0, so does
the launcher. If the launcher itself is killed, the kernel kills its ranks (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

from shard_contract.env import ENV_NAMES, WORKER_MODULE, WorkerEnv, WorkerEnvError

STOP_GRACE_SECONDS = 10.0
RANK_COMMAND = (sys.executable, "-m", WORKER_MODULE)


def rank_environ(environ: Mapping[str, str], local: int, count: int) -> dict[str, str]:
    """The environment of the pod's `local`-th rank of `count`, from the pod's (its first rank's)."""
    first = WorkerEnv.from_env(environ)
    if first.rank + count > first.world_size:
        raise WorkerEnvError(f"RANK={first.rank} with --local-ranks {count} runs ranks past "
                             f"WORLD_SIZE={first.world_size}")
    return {**environ, ENV_NAMES["rank"]: str(first.rank + local), ENV_NAMES["local_rank"]: str(local),
            ENV_NAMES["port"]: str(first.port + local if first.port else 0)}


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills it when the launcher dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _log(message: str) -> None:
    print(f"[shard_worker launcher] {message}", file=sys.stderr, flush=True)


def supervise(count: int, command: Sequence[str] = RANK_COMMAND, environ: Mapping[str, str] | None = None) -> int:
    """Run `count` ranks of `command` until all exit 0 (returns 0) or one fails (returns its status,
    128 + the signal when killed, after stopping the others)."""
    environ = os.environ if environ is None else environ
    envs = [rank_environ(environ, i, count) for i in range(count)]
    procs: list[subprocess.Popen] = []
    running: dict[int, int] = {}  # pid -> local rank, until this loop reaps it

    def forward(signum: int, _frame: object) -> None:
        for pid in list(running):  # os.kill: Popen.send_signal would reap behind os.wait's back
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for env in envs:
            procs.append(subprocess.Popen(list(command), env=env, stdin=subprocess.DEVNULL,
                                          preexec_fn=_die_with_parent))
            running[procs[-1].pid] = len(procs) - 1
        while running:
            pid, status = os.wait()
            local = running.pop(pid, None)
            if local is None:
                continue
            procs[local].returncode = code = os.waitstatus_to_exitcode(status)
            if code != 0:
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                _log(f"rank {envs[local][ENV_NAMES['rank']]} (local rank {local}) {how}: "
                     "stopping the pod's other ranks")
                return code if code > 0 else 128 - code
        return 0
    finally:
        _stop([p for p in procs if p.returncode is None])
        for sig, handler in previous.items():  # the caller's own handlers again
            signal.signal(sig, handler)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shard_worker.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--local-ranks", type=int, required=True, metavar="N", help="ranks (GPUs) in this pod")
    args = parser.parse_args(argv)
    if args.local_ranks < 1:
        parser.error("--local-ranks must be at least 1")
    try:
        return supervise(args.local_ranks)
    except WorkerEnvError as err:
        print(f"shard_worker.launch: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
