"""The decode step the GPU replays (`shard_worker.engine.graphs`), proven on the CPU and, where CUDA is
there, on the device.

On the CPU: the static step (device buffers only, a fixed number of columns read, rows computed
by bucket) gives the eager step's logits; it compiles with torch.compile(fullgraph=True) (no graph
break) to the same logits, reading the paged pool in place (FlexAttention inside the compiled
step), greedy token for token with the eager step that gathers each row's context, over shuffled
block tables; it reads no host value and builds no host tensor (a dispatch-mode guard, and a run
on the meta device, where any host tensor or host read fails). The engine with
SHARD_DECODE_GRAPHS=eager generates what HF generates, at TP x PP, and under continuous batching.

On CUDA (skipped without): replaying captured graphs gives the eager step's tokens, token for
token, in float32; the compiled step (inductor's CUDA graphs, FlexAttention's Triton template)
reads in place what the eager step gathers; a replay does not synchronise with the host (torch's
sync debug mode). `bench/gpu_check.sh` runs this file on the device.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shard_contract.env import DECODE_GRAPHS_ENV, PAGED_ATTENTION_ENV
from shard_worker.comm.dist import Comm, Topology
from shard_worker.engine.graphs import (
    DecodeGraphs,
    batch_buckets,
    chosen_mode,
    decode_forward,
    decode_masks,
    length_buckets,
)
from shard_worker.model.config import ModelConfig
from shard_worker.model.kernels import torch_only
from shard_worker.model.loader import load_stage
from shard_worker.model.model import Stage
from shard_worker.model.paging import BLOCK_SIZE, RESERVED_BLOCKS, TRASH_BLOCK, slot_maps
from shard_worker.model.slices import Layout
from shard_worker.model.step import KVCache, Rotary, Step
from shard_worker.telemetry.accounting import Accounting

from .conftest import make_plan
from .pool import ContinuousJob, GenerateJob
from .test_parallel import PROMPT, assert_matches_hf

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = [pytest.mark.cuda, NO_CUDA]  # what bench/gpu_check.sh runs on a lent GPU (-m cuda)


def cuda(test):
    return pytest.mark.cuda(NO_CUDA(test))


PADS = [0, 3, 1]
PROMPT_COLS, STEPS, MAX_LEN = 7, 6, 24


def load(model_dir, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Stage:
    config = ModelConfig.from_dir(model_dir)
    layout = Layout(config, tp=1, tp_rank=0, layers=(0, config.num_layers), embeds=True, has_lm_head=True)
    stage = Stage(layout, Comm(Topology(rank=0, tp=1, pp=1), Accounting()), dtype, torch.device(device))
    load_stage(stage, model_dir)
    return stage


def prefilled(stage: Stage, ids: torch.Tensor, pads: torch.Tensor) -> tuple[KVCache, Rotary]:
    c, device = stage.config, stage.device
    cache = KVCache(c.num_layers, len(pads), stage.layout.kv_heads, MAX_LEN, c.head_dim, stage.dtype, device)
    rotary = Rotary(c, MAX_LEN, device)
    with torch.inference_mode(), torch_only():
        step = Step.build(0, len(pads), 0, PROMPT_COLS, pads, rotary, stage.windows, stage.dtype, device,
                          tables=cache.contiguous)
        stage.forward(ids[:, :PROMPT_COLS].to(device), step, cache)
    return cache, rotary


def eager_step(stage, cache, rotary, ids, pads, r0, r1, col, tables=None) -> torch.Tensor:
    with torch.inference_mode(), torch_only():
        step = Step.build(r0, r1, col, col + 1, pads, rotary, stage.windows, stage.dtype, stage.device,
                          tables=cache.contiguous if tables is None else tables)
        return stage.logits(stage.forward(ids, step, cache)[:, -1])


def rows_slots(cache: KVCache, pads: torch.Tensor, r0: int, r1: int, cols: int) -> torch.Tensor:
    """The pool slots of columns [0, cols) of rows [r0, r1), by the cache's contiguous tables."""
    return slot_maps(cache.contiguous[r0:r1], pads[r0:r1], torch.zeros_like(pads[r0:r1]), 0, cols)[0].reshape(-1)


def inputs(vocab: int, rows: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, PROMPT_COLS + STEPS), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "llama-mqa"])
def test_the_static_step_gives_the_eager_steps_logits(checkpoint, family):
    """Padded rows, a sliding window that bites, units that start past row 0 once its sequence
    has ended (as continuous batching's live span does: the bucket still computes row 0, its
    result unused), and context buckets crossed on the way (8, 16 columns)."""
    stage = load(checkpoint(family))
    pads = torch.tensor(PADS)
    ids = inputs(stage.config.vocab_size, len(PADS))
    eager_cache, rotary = prefilled(stage, ids, pads)
    static_cache, _ = prefilled(stage, ids, pads)
    graphs = DecodeGraphs(stage, static_cache, rotary, Comm(Topology(0, 1, 1), Accounting()), "eager", min_length=8)
    for i, col in enumerate(range(PROMPT_COLS, PROMPT_COLS + STEPS)):
        r0, r1 = (1, 3) if i >= 3 else (0, 3)  # row 0's sequence ends: the live span starts at row 1
        x = ids[r0:r1, col:col + 1]
        want = eager_step(stage, eager_cache, rotary, x, pads, r0, r1, col)
        with torch.inference_mode():
            got = graphs.run(r0, r1, col, x, pads, static_cache.contiguous)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the static step wrote the same keys and values, in the slots of the rows it was asked for
        slots = rows_slots(static_cache, pads, r0, r1, col + 1)
        torch.testing.assert_close(static_cache.k[:, :, slots], eager_cache.k[:, :, slots])
    assert graphs.captured == 2  # rows bucket 3 (maxBatchSize), columns 8 and 16


def test_buckets():
    assert batch_buckets(1) == [1] and batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(12) == [1, 2, 4, 8, 12]
    assert length_buckets(100) == [100] and length_buckets(2048) == [256, 512, 1024, 2048]
    assert length_buckets(1000) == [256, 512, 1000]


def test_a_cpu_rank_keeps_its_fused_layers(checkpoint, monkeypatch):
    stage = load(checkpoint("llama"))
    comm = Comm(Topology(0, 1, 1), Accounting())
    monkeypatch.delenv(DECODE_GRAPHS_ENV, raising=False)
    assert chosen_mode(stage, comm) == "off"
    assert chosen_mode(stage, comm, "eager") == "eager"
    with pytest.raises(ValueError, match="SHARD_DECODE_GRAPHS"):
        chosen_mode(stage, comm, "sometimes")


def test_the_decode_step_compiles_without_graph_breaks(checkpoint):
    """torch.compile(fullgraph=True) fails on any graph break; the compiled step, reading the pool
    in place (FlexAttention in the graph, its block masks' tensors given), gives the eager step's
    logits (gathered) and the same cache writes."""
    stage = load(checkpoint("mistral"))  # a sliding window, and 2 query heads per KV head
    pads = torch.tensor(PADS)
    ids = inputs(stage.config.vocab_size, len(PADS))
    eager_cache, rotary = prefilled(stage, ids, pads)
    compiled_cache, _ = prefilled(stage, ids, pads)
    torch._dynamo.reset()
    step = torch.compile(decode_forward, fullgraph=True, dynamic=False)
    column, device_pads = torch.tensor([PROMPT_COLS]), pads.clone()
    x = ids[:, PROMPT_COLS:PROMPT_COLS + 1].contiguous()
    with torch.inference_mode():
        masks = decode_masks(stage, compiled_cache, column, device_pads, compiled_cache.contiguous, len(PADS))
        got = step(stage, compiled_cache, rotary, x, column, device_pads, compiled_cache.contiguous, len(PADS), MAX_LEN,
                   masks)
    want = eager_step(stage, eager_cache, rotary, x, pads, 0, len(PADS), PROMPT_COLS)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled_cache.k, eager_cache.k, rtol=1e-5, atol=1e-5)


def test_the_compile_mode_replays_the_eager_steps(checkpoint):
    """SHARD_DECODE_GRAPHS=compile through DecodeGraphs (weights, cache and buffers marked static):
    on the CPU inductor without CUDA graphs, the eager step's logits step after step."""
    stage = load(checkpoint("llama"))
    pads = torch.tensor(PADS)
    ids = inputs(stage.config.vocab_size, len(PADS))
    eager_cache, rotary = prefilled(stage, ids, pads)
    compiled_cache, _ = prefilled(stage, ids, pads)
    torch._dynamo.reset()
    graphs = DecodeGraphs(stage, compiled_cache, rotary, Comm(Topology(0, 1, 1), Accounting()), "compile",
                          min_length=8)
    for col in range(PROMPT_COLS, PROMPT_COLS + 3):
        x = ids[:, col:col + 1]
        want = eager_step(stage, eager_cache, rotary, x, pads, 0, len(PADS), col)
        with torch.inference_mode():
            got = graphs.run(0, len(PADS), col, x, pads, compiled_cache.contiguous)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- no host synchronisation
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}


class NoHostSync(TorchDispatchMode):
    """Fails every aten operation that reads a tensor's value on the host (`.item()`, `.tolist()`,
    `int(t)`, `bool(t)`, data-dependent shapes) or that makes or moves a tensor from the host
    (`torch.tensor(...)`, `.to()` / `.cpu()` / `.copy_()` across devices); with `device`, also every
    operation with an argument on another device (a host tensor mixed into the step). On CUDA
    torch's sync debug mode checks the same of a replay."""

    def __init__(self, device: str | None = None):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            raise AssertionError(f"the step reads a tensor on the host: aten.{name}")
        flat = [x for a in [*args, *kwargs.values()] for x in (a if isinstance(a, (list, tuple)) else (a,))]
        devices = {t.device.type for t in flat if isinstance(t, torch.Tensor)}
        if name in {"lift_fresh", "lift_fresh_copy", "scalar_tensor", "_pin_memory"}:
            raise AssertionError(f"the step builds a host tensor: aten.{name}")
        moved = kwargs.get("device") is not None and torch.device(kwargs["device"]).type not in devices
        if name in {"_to_copy", "copy_"} and (len(devices) > 1 or moved):
            raise AssertionError(f"the step copies across devices: aten.{name} {devices}")
        if self.device is not None and devices - {self.device}:
            raise AssertionError(f"aten.{name} takes a tensor on {devices - {self.device}} in a {self.device} step")
        return func(*args, **kwargs)


def test_the_guard_catches_host_reads_and_host_tensors():
    """The guard can fail: each thing the step must not do fails it. On the CPU `.tolist()` and
    `.cpu()` never reach the dispatcher; on the meta device they are copies to the host, which
    the guard sees (so the step is also run there)."""
    x, meta = torch.ones(3), torch.ones(3, device="meta")
    for bad in (lambda: x.sum().item(), lambda: bool(x.any()), lambda: int(x[0]), lambda: x + torch.tensor([1.0]),
                lambda: x.nonzero(), lambda: meta.tolist(), lambda: meta.cpu(), lambda: meta + torch.ones(3)):
        with pytest.raises(AssertionError, match=r"the step|takes a tensor on"), NoHostSync("meta"):
            bad()
    with NoHostSync("meta"):  # device operators and Python scalars are fine
        (meta * 2 + torch.arange(3, device="meta")).clamp(min=0).masked_fill_(meta > 0, float("-inf"))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_the_decode_step_does_no_host_synchronisation(checkpoint, family):
    """The step through DecodeGraphs on the CPU under the guard, then the whole step on the meta
    device (weights, cache, buffers), where a host value cannot be read and a host tensor cannot
    enter without failing."""
    stage = load(checkpoint(family))
    pads = torch.tensor(PADS)
    ids = inputs(stage.config.vocab_size, len(PADS))
    cache, rotary = prefilled(stage, ids, pads)
    graphs = DecodeGraphs(stage, cache, rotary, Comm(Topology(0, 1, 1), Accounting()), "eager", min_length=8)
    with torch.inference_mode():
        graphs.run(0, 3, PROMPT_COLS, ids[:, PROMPT_COLS:PROMPT_COLS + 1], pads, cache.contiguous)  # copied in outside
        with NoHostSync("cpu"):
            decode_forward(stage, cache, rotary, graphs.x[:4], graphs.column, graphs.pads, graphs.tables, 4, 16)

    config = stage.config
    meta = torch.device("meta")
    layout = Layout(config, tp=1, tp_rank=0, layers=(0, config.num_layers), embeds=True, has_lm_head=True)
    on_meta = Stage(layout, Comm(Topology(0, 1, 1), Accounting()), torch.float32, meta)
    meta_cache = KVCache(config.num_layers, 4, layout.kv_heads, 16, config.head_dim, torch.float32, meta)
    meta_rotary = Rotary(config, 16, meta)
    meta_tables = meta_cache.contiguous.to(meta)
    with torch.inference_mode(), NoHostSync("meta"):
        logits = decode_forward(on_meta, meta_cache, meta_rotary, torch.zeros(4, 1, dtype=torch.int64, device=meta),
                                torch.zeros(1, dtype=torch.int64, device=meta),
                                torch.zeros(4, dtype=torch.int64, device=meta),
                                meta_tables, 4, 16)
    assert logits.shape == (4, config.vocab_size) and logits.device == meta


# ---------------------------------------------------------------- the engine in graph mode

@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_the_engine_with_static_steps_matches_hf(pool, checkpoint, hf_model, tp, pp):
    """SHARD_DECODE_GRAPHS=eager: every decode step through DecodeGraphs (TP collectives of the
    static step on gloo, hidden states between stages), a padded batch: HF's tokens and logits."""
    model_dir = checkpoint("mistral")
    prompts = [PROMPT, PROMPT[2:], PROMPT[5:]]
    job = GenerateJob([{"prompt_ids": p, "max_new_tokens": 6, "ignore_eos": True} for p in prompts],
                      env={DECODE_GRAPHS_ENV: "eager"})
    results = pool.run(make_plan(model_dir, tp, pp, batch=4), model_dir, job)
    assert_matches_hf(results, hf_model(model_dir), prompts)


@pytest.mark.slow
def test_continuous_batching_with_static_steps_is_the_eager_engine(pool, checkpoint):
    """Joins into freed rows (whose whole row is cleared in graph mode), a cancel: the same events
    and tokens as the eager engine."""
    model_dir = checkpoint("llama")
    plan = make_plan(model_dir, 2, 1, batch=3)
    first = [{"prompt_ids": PROMPT[:n], "max_new_tokens": m, "ignore_eos": True} for n, m in ((3, 4), (6, 9), (2, 3))]
    later = {1: [{"prompt_ids": PROMPT[:5], "max_new_tokens": 5, "ignore_eos": True}],
             3: [{"prompt_ids": PROMPT, "max_new_tokens": 4, "ignore_eos": True}]}
    runs = {}
    for mode in ("off", "eager"):
        job = ContinuousJob(first, later, env={DECODE_GRAPHS_ENV: mode})
        results = pool.run(plan, model_dir, job)
        runs[mode] = (results[0]["events"], [c.token_ids for c in results[0]["output"].completions])
    open("/tmp/serve_runs.txt", "w").write(repr(runs))
    assert runs["eager"] == runs["off"]


# ---------------------------------------------------------------- on a CUDA device
@cuda
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_cuda_graph_replay_equals_eager_token_for_token(checkpoint, family):
    """float32, greedy: the replayed steps choose the eager steps' tokens at every step, with the
    same logits (TF32 off, as the ranks run float32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    stage = load(checkpoint(family), "cuda")
    pads = torch.tensor(PADS)
    ids = inputs(stage.config.vocab_size, len(PADS))
    eager_cache, rotary = prefilled(stage, ids, pads)
    graph_cache, _ = prefilled(stage, ids, pads)
    graphs = DecodeGraphs(stage, graph_cache, rotary, Comm(Topology(0, 1, 1), Accounting()), "cuda", min_length=8)
    eager_tokens = graph_tokens = ids[:, PROMPT_COLS:PROMPT_COLS + 1].cuda()
    for col in range(PROMPT_COLS, PROMPT_COLS + STEPS):
        want = eager_step(stage, eager_cache, rotary, eager_tokens, pads, 0, 3, col)
        with torch.inference_mode():
            got = graphs.run(0, 3, col, graph_tokens, pads, graph_cache.contiguous)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        eager_tokens, graph_tokens = want.argmax(-1, keepdim=True), got.argmax(-1, keepdim=True)
        assert torch.equal(graph_tokens, eager_tokens), f"column {col}"
    assert graphs.captured >= 2


@cuda
def test_cuda_replay_does_not_synchronise(checkpoint):
    stage = load(checkpoint("llama"), "cuda")
    pads = torch.tensor(PADS)
    ids = inputs(stage.config.vocab_size, len(PADS))
    cache, rotary = prefilled(stage, ids, pads)
    graphs = DecodeGraphs(stage, cache, rotary, Comm(Topology(0, 1, 1), Accounting()), "cuda", min_length=8)
    x = ids[:, PROMPT_COLS:PROMPT_COLS + 1].cuda()
    with torch.inference_mode():
        # captures the 8- and 16-column buckets (a capture may synchronise: torch.cuda.graph does
        # as it begins) and copies the padding in once; the steps after replay the 16-column one
        for col in (PROMPT_COLS, PROMPT_COLS + 1):
            x = graphs.run(0, 3, col, x, pads, graphs.cache.contiguous).argmax(-1, keepdim=True)
        assert graphs.captured == 2
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for col in range(PROMPT_COLS + 2, PROMPT_COLS + 5):
                x = graphs.run(0, 3, col, x, pads, graphs.cache.contiguous).argmax(-1, keepdim=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@cuda
def test_the_steps_host_copy_lands_in_pinned_memory():
    """The sampler's one device-to-host copy of a step (ids and log-probabilities) lands in pinned
    memory, and a seed draws on the device what it draws on the host."""
    from shard_contract.wire import GenerateRequest
    from shard_worker.engine.sampling import Sampler

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(7)) * 3
    requests = [GenerateRequest(prompt_ids=[1], temperature=1.0, seed=r, logprobs=2) for r in range(3)]
    samplers = [Sampler(3), Sampler(3)]
    for sampler in samplers:
        for row, request in enumerate(requests):
            sampler.place(row, request)
    on_host = samplers[0].sample(logits).to_host()
    sampled = samplers[1].sample(logits.cuda())
    assert sampled.staging is not None and sampled.staging.bytes.is_pinned()
    on_device = sampled.to_host()
    assert on_device.tokens == on_host.tokens
    assert on_device.logprob == pytest.approx(on_host.logprob, abs=1e-5)


# ---------------------------------------------------------------- the compiled step, CPU and CUDA
# (last: on a device its compile is the longest of these, so the tests above run first)
def paged_batch(vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids [3, 40], left paddings [0, 5, 2] and block tables [4, 3] (a fourth row no sequence holds:
    all TRASH) over a pool of 12 blocks, shuffled (not the contiguous ones)."""
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, vocab, (3, 40), generator=gen)
    tables = torch.full((4, 3), TRASH_BLOCK, dtype=torch.int64)
    tables[:3] = (torch.randperm(12, generator=gen)[:9] + RESERVED_BLOCKS).view(3, 3)
    return ids.to(device), torch.tensor([0, 5, 2, 0]), tables


@pytest.mark.parametrize("device", [pytest.param(d, marks=CUDA if d == "cuda" else []) for d in ("cpu", "cuda")
                                    if d in os.environ.get("SHARD_TEST_DEVICES", "cpu,cuda").split(",")])
def test_the_compiled_step_reads_in_place_what_the_eager_step_gathers(checkpoint, monkeypatch, device):
    """SHARD_DECODE_GRAPHS=compile, whose step reads the pool in place (FlexAttention lowered inside
    the compiled step), against the eager step gathering each row's context, greedy, token for
    token (float32): three rows left-padded by 0, 5 and 2 over shuffled block tables, a 20-column
    prompt and 20 steps, so that every row crosses into its third block; the step's bucket also
    computes a fourth row that no sequence holds. Every slot but the ZERO block starts as NaN: a
    read of a slot no row wrote, or of a key past a row's own, would show."""
    torch.backends.cuda.matmul.allow_tf32 = False
    stage = load(checkpoint("mistral"), device)  # two layers (each must read its own pool), a window, GQA
    c = stage.config
    ids, pads, tables = paged_batch(c.vocab_size, device)
    caches = []
    for _ in range(2):
        cache = KVCache(c.num_layers, 4, stage.layout.kv_heads, 48, c.head_dim, torch.float32, stage.device)
        cache.k[:, :, BLOCK_SIZE:], cache.v[:, :, BLOCK_SIZE:] = float("nan"), float("nan")
        rotary = Rotary(c, 48, stage.device)
        with torch.inference_mode(), torch_only():
            step = Step.build(0, 3, 0, 20, pads, rotary, stage.windows, stage.dtype, stage.device, tables=tables)
            stage.forward(ids[:, :20], step, cache)
        caches.append(cache)
    eager_cache, graph_cache = caches
    torch._dynamo.reset()
    graphs = DecodeGraphs(stage, graph_cache, rotary, Comm(Topology(0, 1, 1), Accounting()), "compile",
                          min_length=48)
    tokens = ids[:, 20:21]
    for col in range(20, 40):
        with monkeypatch.context() as env:
            env.setenv(PAGED_ATTENTION_ENV, "gather")
            want = eager_step(stage, eager_cache, rotary, tokens, pads, 0, 3, col, tables)
        with monkeypatch.context() as env, torch.inference_mode():
            env.setattr(KVCache, "gather", forbidden)  # the compiled step must not take the gather
            env.setattr(DecodeGraphs, "_record", lambda *_: ())  # nor its eager run (TP=1: no collectives)
            got = graphs.run(0, 3, col, tokens, pads, tables).clone()
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"column {col}"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        tokens = want.argmax(-1, keepdim=True)
    assert graphs.captured == 1


def forbidden(*args, **kwargs):
    raise AssertionError("the compiled step gathered the rows' contexts")
