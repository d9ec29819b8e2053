"""One rank, assembled from its environment and the Plan: join the group, build and load this
rank's stage, allocate its KV cache, and measure what that costs in memory."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shard_contract.env import WorkerEnv
from shard_contract.plan import Plan, RankPlan
from shard_contract.sharding import prefill_rows
from shard_contract.wire import RankReport, ResidentBytes

from ..comm import dist as dist_mod
from ..comm.dist import Comm, Topology
from ..engine.engine import Engine
from ..engine.warmup import WarmupOutOfMemory, warm_up
from ..model.config import ModelConfig
from ..model.loader import load_stage
from ..model.model import Stage
from ..model.offload import Streamer
from ..model.slices import Layout
from ..model.step import KVCache, Rotary
from ..telemetry.accounting import Accounting, CudaClock, MemorySample

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PlanMismatch(ValueError):
    pass


class ActivationsDoNotFit(PlanMismatch):
    """The warm-up pass (the plan's largest forward pass) ran out of the device's memory."""


class MemoryBudgetExceeded(PlanMismatch):
    """The rank would hold (or holds) more than its device's memory budget (SHARD_MEMORY_BUDGET)."""


def check_budget(what: str, nbytes: int, budget: int | None) -> None:
    """A simulated device has a hard memory limit, as a GPU has: refuse to go over it."""
    if budget is not None and nbytes > budget:
        raise MemoryBudgetExceeded(f"{what} {nbytes / 2**20:.1f} MiB exceed this device's memory budget of "
                                   f"{budget / 2**20:.1f} MiB (SHARD_MEMORY_BUDGET)")


def device_for(rank_plan: RankPlan, env: WorkerEnv) -> torch.device:
    if rank_plan.kind == "gpu":
        # One growing segment instead of a 2 MiB-rounded block per tensor: what CUDA reserves for
        # the weights is then what they need (the plan), not that plus each tensor's rounding.
        # Read when the caching allocator starts, which is after this.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if not torch.cuda.is_available():
            raise PlanMismatch(f"the plan puts rank {rank_plan.rank} on {rank_plan.device}, "
                               "but CUDA is not available in this process")
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def check_env(env: WorkerEnv, plan: Plan) -> RankPlan:
    if (env.tp_size, env.pp_size) != (plan.tensor_parallel, plan.pipeline_parallel):
        raise PlanMismatch(f"TP_SIZE={env.tp_size} PP_SIZE={env.pp_size} disagree with the plan "
                           f"(tensor {plan.tensor_parallel}, pipeline {plan.pipeline_parallel})")
    return plan.rank_plan(env.replica, env.rank)


def resident_bytes(baseline: MemorySample, started: MemorySample, before: MemorySample, loaded: MemorySample,
                   cached: MemorySample, staged: MemorySample, on_cuda: bool) -> ResidentBytes:
    """What a rank measured while it loaded (`before`, `loaded`: around the weights; `cached`: after
    the KV cache; `staged`: after offload's staging slots, if any). Weights, KV cache and staging are
    the growth of what holds them: what CUDA's caching allocator reserved, or anonymous memory. The
    total is, on a GPU, the device memory in use above what it held when CUDA `started` in this process
    (so NCCL's buffers, cuBLAS workspaces, lazily loaded kernels and the allocator's reserve count,
    not only torch's allocator; the primary context created at that moment, and other processes, do
    not); on a CPU, anonymous memory above the bare process."""
    return ResidentBytes(
        weights=loaded.held(on_cuda) - before.held(on_cuda),
        kv_cache=cached.held(on_cuda) - loaded.held(on_cuda),
        staging=staged.held(on_cuda) - cached.held(on_cuda),
        rss_anon=staged.rss_anon, cuda_allocated=staged.cuda_allocated,
        total=staged.cuda_used - started.cuda_used if on_cuda else staged.rss_anon - baseline.rss_anon,
        peak=staged.peak_rss - baseline.rss)


# bfloat16 runs natively from compute capability 8.0 (Ampere) on; T4 (7.5) and V100 (7.0) emulate it.
BF16_CAPABILITY = (8, 0)


def agreed_dtype(planned: str, capability: tuple[int, int] | None, comm: Comm) -> tuple[torch.dtype, str]:
    """The dtype the group runs, and why when it is not the plan's. `capability`: this rank's GPU
    (None on a CPU). bfloat16 where any rank's GPU has no native bfloat16 becomes float16 on every
    rank (the same bytes; ranks must agree, since their hidden states cross stages). The planner
    already plans float16 for `dtype: auto` where GPU feature discovery labels tell it the compute
    capability; this covers GPUs it could not see."""
    if planned != "bfloat16" or comm.all_true(capability is None or capability >= BF16_CAPABILITY):
        return DTYPES[planned], ""
    whose = f"this GPU (compute capability {capability[0]}.{capability[1]})" \
        if capability is not None and capability < BF16_CAPABILITY else "another rank's GPU"
    return torch.float16, (f"the plan says bfloat16, which {whose} does not run natively (it needs compute "
                           "capability 8.0): the group runs float16")


def freeze_loaded_objects() -> None:
    """Once the rank has loaded, in the process that runs it: the objects alive now (torch's, the
    model's, the libraries') live as long as the process, so move them out of the cyclic garbage
    collector's reach (`gc.freeze`, as pre-forking servers do). Walking them cost 4-5% of every
    bfloat16 decode step at TP=1 (perf, the 853M model): the GC's full collections, which a step's
    short-lived objects set off, visit every tracked object. With it, such a rank decoded at
    0.86-1.00 of the one-core read limit in three rounds of four, against 0.80-0.82 without."""
    gc.collect()
    gc.freeze()


def cache_rows(plan: Plan) -> int:
    """Rows of the paged KV cache: the most sequences that run at once (maxBatchSize; each holds
    only the blocks it needs). They decode together; their prompts prefill in passes of at most
    the rows the plan sized activations for (`warm_rows`)."""
    return max(1, plan.max_batch_size)


def warm_rows(plan: Plan, rank_plan: RankPlan) -> int:
    """Rows of the largest prefill pass, which the warm-up runs: `prefill_rows` of the plan."""
    return prefill_rows(plan.max_batch_size, plan.max_model_len, rank_plan.kind)


def cache_tokens(plan: Plan, rank_plan: RankPlan) -> int:
    """Positions of the paged KV cache's pool: the fewest any rank of the group has (the leader's
    block ids must exist on every rank)."""
    return min(r.kv_cache_tokens for r in plan.group(rank_plan.replica))


@dataclass
class Worker:
    env: WorkerEnv
    plan: Plan
    rank_plan: RankPlan
    comm: Comm
    stage: Stage
    cache: KVCache
    rotary: Rotary
    acct: Accounting
    baseline: MemorySample
    resident: ResidentBytes
    allocated: dict[str, int]
    load_seconds: float
    streamer: Streamer | None = None
    engine: Engine = field(init=False)

    def __post_init__(self) -> None:
        self.engine = Engine(self.stage, self.cache, self.comm, self.rotary, self.acct, self.env.model_dir,
                             self.plan.max_model_len, report=self.report)

    @property
    def topo(self) -> Topology:
        return self.comm.topo

    @classmethod
    def start(cls, env: WorkerEnv, plan: Plan, baseline: MemorySample | None = None,
              connect: Callable[[WorkerEnv, Topology, torch.device, Accounting], Comm] = dist_mod.init_comm,
              progress: Callable[[int, int], None] | None = None) -> Worker:
        """Join the group and load this rank's slices. `baseline`: memory of the bare process;
        `connect`: how the rank joins its group (tests pass communicators of their own);
        `progress(loaded, total)`: bytes of its tensors filled, as the load goes."""
        rank_plan = check_env(env, plan)
        # Before joining the group: a plan that overfills the device fails fast, with no load.
        check_budget("the plan's predicted bytes of this rank", rank_plan.predicted_bytes.total,
                     env.memory_budget_bytes)
        device = device_for(rank_plan, env)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # cuDNN's attention builds a graph for every new key length: SDPA picks it for
            # bfloat16 on Hopper, and each decode step then cost ~45 ms (measured on an H200;
            # docs/benchmarks.md). Flash and memory-efficient attention take any length.
            torch.backends.cuda.enable_cudnn_sdp(False)
        started = MemorySample.take(device)  # on a GPU, what the device holds as CUDA starts here
        baseline = baseline or started
        config = ModelConfig.from_dir(env.model_dir)
        topo = Topology(rank=env.rank, tp=env.tp_size, pp=env.pp_size)
        acct = Accounting(CudaClock() if device.type == "cuda" else None)
        comm = connect(env, topo, device, acct)
        dtype, why = agreed_dtype(plan.dtype, torch.cuda.get_device_capability(device) if device.type == "cuda"
                                  else None, comm)
        if why:
            print(f"[shard_worker rank {env.rank}] warning: {why}", file=sys.stderr, flush=True)
        layout = Layout(config, tp=topo.tp, tp_rank=topo.tp_rank, layers=(rank_plan.layers[0], rank_plan.layers[1]),
                        embeds=rank_plan.embeds, has_lm_head=rank_plan.has_lm_head)
        on_cuda = device.type == "cuda"

        streamer = None
        try:
            before = MemorySample.take(device)
            offload = rank_plan.offload
            stage = Stage(layout, comm, dtype, device, plan.quantization, streamed=offload.layers if offload else ())
            stats = load_stage(stage, env.model_dir, progress)
            loaded = MemorySample.take(device)
            # paged: the group's KV tokens in blocks (every rank holds the blocks the leader hands out)
            cache = KVCache(layout.layers[1] - layout.layers[0], cache_rows(plan), layout.kv_heads,
                            plan.max_model_len, config.head_dim, dtype, device, tokens=cache_tokens(plan, rank_plan))
            cached = MemorySample.take(device)
            if offload is not None:  # the staging slots (and a GPU's pinned host copies); started
                # now, since the warm-up's forward pass below waits on the layers it streams
                streamer = stage.streamer = Streamer(stage, offload, env.model_dir, acct).start()
            staged = MemorySample.take(device)
            rotary = Rotary(config, plan.max_model_len, device)

            resident = resident_bytes(baseline, started, before, loaded, cached, staged, on_cuda)
            # Before ready: the plan's largest forward pass, so that its activations fail here
            # (a plan-level reason) rather than under the first big load.
            try:
                warm = warm_up(stage, cache, rotary, warm_rows(plan, rank_plan), plan.max_model_len)
            except WarmupOutOfMemory as err:
                raise ActivationsDoNotFit(str(err)) from None
            peak = max(staged.peak_rss, MemorySample.take(device).peak_rss) - baseline.rss
            resident = resident.model_copy(update={"activations": warm.activations, "peak": (
                resident.total + warm.activations if on_cuda else peak)})
            check_budget(f"resident bytes at the warm-up's peak ({warm.rows} rows x {warm.cols} prefill tokens)",
                         resident.total + warm.activations, env.memory_budget_bytes)
            allocated = {"weights": sum(t.numel() * t.element_size() for t in stage.tensors().values()),
                         "kv_cache": cache.nbytes, "staging": streamer.nbytes if streamer else 0}
        except BaseException:
            if streamer is not None:
                streamer.close()
            dist_mod.shutdown()  # leave no half-built group behind
            raise
        return cls(env=env, plan=plan, rank_plan=rank_plan, comm=comm, stage=stage, cache=cache, rotary=rotary,
                   acct=acct, baseline=baseline, resident=resident, allocated=allocated, load_seconds=stats.seconds,
                   streamer=streamer)

    def loaded(self, ready_seconds: float) -> str:
        """What the rank says once it has loaded (`ready_seconds` since it started)."""
        r, rp = self.resident, self.rank_plan
        streams = (f"; streams layers {rp.offload.layers} from {rp.offload.tier} through {rp.offload.prefetch} "
                   f"slots ({r.staging / 2**20:.1f} MiB)") if rp.offload else ""
        return (f"stage {rp.stage} tp {rp.tp_rank} layers {list(rp.layers)}: loaded in {self.load_seconds:.2f}s "
                f"(ready in {ready_seconds:.2f}s); weights {r.weights / 2**20:.1f} MiB, "
                f"KV cache {r.kv_cache / 2**20:.1f} MiB resident{streams}")

    def report(self) -> dict:
        now = MemorySample.take(self.stage.device)
        resident = self.resident if self.stage.device.type == "cuda" else self.resident.model_copy(
            update={"peak": max(self.resident.peak, now.peak_rss - self.baseline.rss)})
        c = self.acct.counters
        return RankReport(
            dtype=str(self.stage.dtype).removeprefix("torch."), resident_bytes=resident, allocated_bytes=self.allocated,
            load_seconds=self.load_seconds, comm_seconds=c.comm_total, compute_seconds=c.compute_seconds,
            idle_seconds=c.idle_seconds, comm_bytes=dict(c.comm_bytes), last_generate=self.engine.last_generate,
            streamed_bytes=c.streamed_bytes, stream_seconds=c.stream_seconds, stall_seconds=c.stall_seconds,
            device_stall_seconds=c.device_stall_seconds,
        ).model_dump(mode="json")

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
        dist_mod.shutdown()
