"""One group of worker ranks as local processes: the laptop twin of a group of pods.

Each rank is `python -m shard_worker`, configured exactly as in a pod: a `WorkerEnv` in its
environment and the Plan in a file. `LocalGroup` starts the ranks on free ports, watches them, and
stops every process it started on every way out (return, exception, Ctrl-C, SIGTERM; and if this
process is killed outright, the kernel kills the ranks: PR_SET_PDEATHSIG). Torch-free.

The group talks over loopback only: rank 0's rendezvous store listens on 127.0.0.1 (MASTER_ADDR),
and gloo and NCCL are pointed at the loopback interface. Each group gets a fresh secret key for
its heartbeat records, in a file only this user can read (mode 0600 in a private directory),
named by SHARD_GROUP_SECRET_FILE and removed when the group stops. A file rather than the key
itself in an environment variable: every process the ranks start inherits their environment,
and the pods read the operator's Secret from a file too, so both run one code path.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shard_contract.env import ENV_NAMES, EXIT_CONFIG, RESULT_ENV, TASK_ENV, WORKER_MODULE, WorkerEnv, new_group_key
from shard_contract.plan import Plan
from shard_contract.wire import GenerateResult, GenerateTask

from ..api import ModelSpec, Parallelism, Serving, ShardedModelSpec
from ..planning import plan as make_plan
from ..planning.inventory import DeviceKind, local_inventory, parse_devices
from ..planning.profile import profile_model

POLL_SECONDS = 0.05
STOP_GRACE_SECONDS = 5.0


class LaunchError(RuntimeError):
    """A rank failed or the group did not finish in time; the message carries the rank's log tail.
    `permanent`: the rank said a restart would fail the same way (it exited EXIT_CONFIG)."""

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


def plan_local(model_dir: str | os.PathLike[str], tp: int, pp: int, *, dtype: str = "auto",
               quantization: str = "none", max_model_len: int | None = None, max_batch_size: int = 1,
               devices: str | None = None, device_kind: DeviceKind = "cpu", layer_partition: list[int] | None = None,
               kv_cache_memory_fraction: float | None = None, kv_cache_memory: str | None = None) -> Plan:
    """Plan `model_dir` over TP x PP ranks of this machine (or the `devices` spec); the KV cache
    as spec.serving gives it: a fraction of the free memory, or a quantity such as "512MiB"."""
    profile = profile_model(model_dir)
    spec = ShardedModelSpec(
        model=ModelSpec(path=str(model_dir), dtype=dtype, quantization=quantization, max_model_len=max_model_len,
                        max_batch_size=max_batch_size),
        parallelism=Parallelism(tensor=tp, pipeline=pp, layer_partition=layer_partition),
        serving=Serving(kv_cache_memory_fraction=kv_cache_memory_fraction, kv_cache_memory=kv_cache_memory))
    inventory = parse_devices(devices, kind=device_kind) if devices is not None else local_inventory(ranks=tp * pp)
    return make_plan(profile, spec, inventory)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortInUse(ValueError):
    pass


def check_port(host: str, port: int, flag: str) -> None:
    """Raise `PortInUse`, naming the port and its flag, when a server could not listen on it now."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAITs do not count
        try:
            s.bind(address)
        except OSError as err:
            raise PortInUse(f"{flag} {port}: cannot listen on {host}:{port} ({err.strerror}); another process "
                            f"holds it: stop it, or choose another port ({flag} 0 takes a free one)") from None


def loopback_interface() -> str | None:
    """The loopback interface's name, where this machine has one ("lo" on Linux, "lo0" on macOS)."""
    return next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None)


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills it when the launcher dies (Linux only)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class RankProcess:
    rank: int
    process: subprocess.Popen
    log: Path
    port: int = 0  # its HTTP port (SHARD_PORT)

    @property
    def permanent(self) -> bool:
        """It failed in a way a restart would repeat (a bad checkpoint, a plan it cannot run)."""
        return self.process.returncode == EXIT_CONFIG

    def exit_reason(self) -> str:
        """How it ended, as a person says it: a status, or the signal that killed it."""
        code = self.process.returncode
        if code is not None and code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        if self.permanent:
            return f"exited with status {code} (a restart would fail the same way)"
        return f"exited with status {code}"

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class LocalGroup:
    """The ranks of one replica of `plan`, started by `start()` (or `with`), stopped by `stop()`."""

    def __init__(self, plan: Plan, model_dir: str | os.PathLike[str], workdir: str | os.PathLike[str], *,
                 replica: int = 0, extra_env: Mapping[str, str] | None = None,
                 threads_per_rank: int | None = None, rendezvous_timeout: int = 120,
                 python: str = sys.executable, leader_port: int | None = None,
                 rendezvous_port: int | None = None):
        """`leader_port`: rank 0's HTTP port (the API); `rendezvous_port`: its store's; every other
        port is a free one."""
        self.plan, self.model_dir, self.workdir = plan, Path(model_dir), Path(workdir)
        self.leader_port, self.rendezvous_port = leader_port, rendezvous_port
        self.replica, self.extra_env = replica, dict(extra_env or {})
        self.threads = threads_per_rank or max(1, (os.cpu_count() or 1) // plan.world_size)
        self.rendezvous_timeout, self.python = rendezvous_timeout, python
        self.ranks: list[RankProcess] = []
        self._secret_dir: Path | None = None

    @property
    def secret_file(self) -> Path:
        """The file with this group's secret key: made on first use, removed by `stop()`."""
        if self._secret_dir is None:
            self._secret_dir = Path(tempfile.mkdtemp(prefix="shard-group-"))  # mode 0700
            fd = os.open(self._secret_dir / "key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(new_group_key())
        return self._secret_dir / "key"

    def __enter__(self) -> LocalGroup:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def rank_env(self, rank: int, master_port: int, plan_file: Path) -> dict[str, str]:
        rank_plan = self.plan.rank_plan(self.replica, rank)
        env = WorkerEnv(rank=rank, world_size=self.plan.world_size, local_rank=rank_plan.device_index,
                        master_addr="127.0.0.1", master_port=master_port, tp_size=self.plan.tensor_parallel,
                        pp_size=self.plan.pipeline_parallel, replica=self.replica, plan_file=str(plan_file),
                        model_dir=str(self.model_dir.resolve()), model_name=self.plan.model,
                        port=self.leader_port if rank == 0 and self.leader_port else free_port(),
                        backend="auto", rendezvous_timeout=self.rendezvous_timeout,
                        group_secret_file=str(self.secret_file))
        threads = str(self.threads)
        lo = loopback_interface()
        loopback = {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo} if lo else {}
        return {**loopback, **os.environ, **env.to_env(), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                "PYTHONUNBUFFERED": "1", **self.extra_env}

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        plan_file = self.workdir / "plan.json"
        plan_file.write_text(self.plan.to_json())
        master_port = self.rendezvous_port or free_port()
        try:
            for rank in range(self.plan.world_size):
                log = self.workdir / f"rank-{rank}.log"
                env = self.rank_env(rank, master_port, plan_file)
                with open(log, "wb") as out:
                    proc = subprocess.Popen([self.python, "-m", WORKER_MODULE], env=env, stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
                self.ranks.append(RankProcess(rank, proc, log, int(env[ENV_NAMES["port"]])))
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> list[int]:
        return [r.process.pid for r in self.ranks]

    def failure(self) -> LaunchError | None:
        """The first rank that ended with an error (one that failed for good before the others, whose
        errors may only be the group breaking), as an error naming it and quoting its log."""
        failed = sorted((r for r in self.ranks if r.process.poll() not in (None, 0)), key=lambda r: not r.permanent)
        if not failed:
            return None
        first = failed[0]
        others = ", ".join(f"rank {r.rank}" for r in failed[1:])
        also = f" (also failed: {others})" if others else ""
        return LaunchError(f"rank {first.rank} {first.exit_reason()}{also}; its log ends:\n{first.tail()}",
                           permanent=first.permanent)

    def wait(self, timeout: float) -> None:
        """Until every rank exits 0. A failing rank or the deadline raises `LaunchError`."""
        deadline = time.monotonic() + timeout
        while True:
            codes = [r.process.poll() for r in self.ranks]
            failure = self.failure()
            if failure is not None:
                raise failure
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                running = [r.rank for r, code in zip(self.ranks, codes, strict=True) if code is None]
                raise LaunchError(f"ranks {running} still running after {timeout:.0f}s; "
                                  f"rank {running[0]}'s log ends:\n{self.ranks[running[0]].tail()}")
            time.sleep(POLL_SECONDS)

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """Terminate every rank still running; kill those that outlive `grace` seconds."""
        live = [r.process for r in self.ranks if r.process.poll() is None]
        for proc in live:
            proc.terminate()
        deadline = time.monotonic() + grace
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._secret_dir is not None:
            shutil.rmtree(self._secret_dir, ignore_errors=True)
            self._secret_dir = None


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while inside, so `finally` and `with` blocks still run."""
    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_generate(plan: Plan, model_dir: str | os.PathLike[str], task: GenerateTask, *, timeout: float = 600,
                 threads_per_rank: int | None = None) -> GenerateResult:
    """Start the group, run one generation task on it, and return the leader's result."""
    with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="shardctl-") as tmp:
        workdir = Path(tmp)
        (workdir / "task.json").write_text(task.model_dump_json())
        env = {TASK_ENV: str(workdir / "task.json"), RESULT_ENV: str(workdir / "result.json")}
        with LocalGroup(plan, model_dir, workdir, extra_env=env, threads_per_rank=threads_per_rank) as group:
            group.wait(timeout)
        return GenerateResult.model_validate_json((workdir / "result.json").read_text())
