"""The worker on every device this process has: the CPU always, and CUDA where torch sees a GPU.

Every test takes `device` ("cpu" or "cuda") and runs one rank whose plan puts it there (the
planner's device kind cpu or gpu: with `RankPlan.kind == "gpu"` the rank takes `cuda:LOCAL_RANK`
itself). So the logic is proven on the CPU of every machine, and the very same code runs on a GPU
where there is one (bench/gpu_check.sh). SHARD_TEST_DEVICES=cuda (or cpu) keeps one of them.

One rank only: NCCL refuses two ranks on one GPU, and these tests must run on a machine with one,
so tensor and pipeline parallelism on CUDA (NCCL collectives and send/recv) are out of their
reach; the CPU tests cover those layouts over gloo.

On the device: greedy tokens and float32 logits equal to HF transformers' on the same device (no
TF32 on either side); bfloat16 groups that generate; resident bytes after load against the plan
for every checkpoint dtype x runtime dtype pair; int8 weights (on CUDA, torch's
`_weight_int8pack_mm` for decode rows); offload (on CUDA: pinned host copies, a side stream,
double-buffered slots) computing the resident run's logits bit for bit; and `shardctl run`
serving a completion through its HTTP API.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from shard_operator.local.demo_model import DemoShape, write_demo_model
from shard_operator.local.launcher import plan_local
from tests.support.offload import streaming_plan
from tests.support.processes import shardctl

from .conftest import SHAPE
from .pool import GenerateJob, JobFailed
from .test_int8 import LOGITS_TOLERANCE, int8_reference
from .test_parallel import PROMPT, assert_matches_hf, hf_logits

WANTED = os.environ.get("SHARD_TEST_DEVICES", "cpu,cuda").split(",")
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device in this process")
DEVICES = [pytest.param(d, marks=[NO_CUDA, pytest.mark.cuda] if d == "cuda" else []) for d in ("cpu", "cuda")
           if d in WANTED]
pytestmark = [pytest.mark.slow, pytest.mark.parametrize("device", DEVICES)]

# A rank's device: one of its own (on a GPU the planner adds 2.5 GiB of CUDA context, cuBLAS and
# NCCL overhead to what the model needs).
MEMORY = "16GiB"
# As `shardctl run` starts its ranks: gloo (the control group) and NCCL over loopback.
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
JOB_TIMEOUT = 120.0  # a small job: a hung CUDA call fails its test, not the whole run
# Expandable segments (the worker's allocator setting) map the caching allocator's large pool in
# 20 MiB pieces and its small pool in 2 MiB ones: what CUDA reserves for the weights exceeds their
# bytes by up to that, whatever their size.
CUDA_SEGMENTS = 22 * 2**20


def kind_of(device: str) -> str:
    return "gpu" if device == "cuda" else "cpu"


def device_plan(model_dir, device: str, *, batch: int = 1, dtype: str = "float32", quantization: str = "none"):
    """A plan of one rank on `device`."""
    plan = plan_local(model_dir, 1, 1, dtype=dtype, quantization=quantization, max_model_len=64,
                      max_batch_size=batch, devices=f"localhost:{MEMORY}", device_kind=kind_of(device))
    assert plan.ranks[0].kind == kind_of(device)
    return plan


def generate(pool, plan, model_dir, prompts: list[list[int]], new_tokens: int = 5) -> list[dict]:
    job = GenerateJob([{"prompt_ids": p, "max_new_tokens": new_tokens, "ignore_eos": True} for p in prompts],
                      env=LOOPBACK)
    try:
        results = pool.run(plan, model_dir, job, timeout=JOB_TIMEOUT)
    except JobFailed:
        if plan.ranks[0].kind == "gpu":  # a CUDA error can poison the process: the next test gets a fresh one
            pool.close()
        raise
    # IEEE float32 matmuls in the rank (TF32 would be ~1e-3 off HF's)
    assert results[0]["float32_matmul"] == "highest"
    return results


@pytest.fixture(scope="module")
def reference(hf_model):
    """reference(directory, device, int8=False) -> the HF model (float32) on `device`; with int8,
    its projections quantized and dequantized as an int8 rank computes them."""
    made = {}

    def get(directory, device: str, int8: bool = False):
        if (directory, device, int8) not in made:
            model = int8_reference(hf_model(directory), 1) if int8 else copy.deepcopy(hf_model(directory))
            made[directory, device, int8] = model.to(device)
        return made[directory, device, int8]
    # and IEEE float32 in this process, for HF's reference
    assert torch.get_float32_matmul_precision() == "highest"
    return get


def logits_of(result: dict, row: int = 0) -> torch.Tensor:
    return torch.stack([step[row] for step in result["output"].logits])


# ---------------------------------------------------------------- the model, as HF computes it
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_float32_matches_hf_on_the_same_device(pool, checkpoint, reference, device, family):
    """Greedy tokens and float32 logits at every generated position equal HF's on the device
    (rtol = atol = 1e-4, as in every CPU test), for a left-padded batch of two prompts."""
    model_dir = checkpoint(family)
    prompts = [PROMPT, PROMPT[:3]]
    results = generate(pool, device_plan(model_dir, device, batch=2), model_dir, prompts)
    assert_matches_hf(results, reference(model_dir, device), prompts)
    assert results[0]["reports"][0]["dtype"] == "float32"  # where it ran is its RankPlan's (the plan's device)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_bfloat16_generates(pool, checkpoint, reference, device, quantization):
    """A bfloat16 rank (native from compute capability 8.0; an H100/H200 runs it as planned), with
    and without int8 weights, generates finite logits close to the float32 model's along its own
    tokens: within 0.15 of their spread (bfloat16 keeps 8 bits of mantissa; a CPU measures 0.04)."""
    model_dir = checkpoint("llama")
    plan = device_plan(model_dir, device, dtype="bfloat16", quantization=quantization)
    results = generate(pool, plan, model_dir, [PROMPT], new_tokens=8)
    assert results[0]["reports"][0]["dtype"] == "bfloat16"
    tokens = results[0]["output"].completions[0].token_ids
    assert len(tokens) == 8
    ours = logits_of(results[0])
    assert bool(torch.isfinite(ours).all())
    theirs = hf_logits(reference(model_dir, device, int8=quantization == "int8"), PROMPT, tokens)
    error = (ours - theirs).abs().max().item() / theirs.std().item()
    print(f"{device} bfloat16 ({quantization}) vs float32: largest logit error {error:.4f} of their spread")
    assert error < 0.15


# ---------------------------------------------------------------- int8
def test_int8_is_the_quantized_model(pool, checkpoint, reference, device):
    """int8 weights with float32 activations compute the unsharded int8 reference (HF with the
    same quantization, dequantized): same greedy tokens and logits. A 12-token prompt beside an
    8-token one: the prefill's 24 rows take the dequantizing path, the decode's 2 rows the int8
    kernel (on CUDA torch's `_weight_int8pack_mm`, on a CPU ours)."""
    model_dir = checkpoint("llama")
    prompts = [PROMPT, PROMPT[::-1] + [1, 2, 3, 4]]
    plan = device_plan(model_dir, device, batch=2, quantization="int8")
    results = generate(pool, plan, model_dir, prompts, new_tokens=6)
    # within float rounding of the same quantized model (test_int8: a value that rounding moves across
    # a grid boundary of the activations' int16 quantization lands one step away)
    assert_matches_hf(results, reference(model_dir, device, int8=True), prompts, tolerance=LOGITS_TOLERANCE)


# ---------------------------------------------------------------- memory
MEASURE = """
import ctypes, json, sys, torch
from shard_contract.env import WorkerEnv
from shard_contract.plan import Plan
from shard_operator.local.launcher import free_port
from shard_worker.rank.runtime import Worker
plan, model_dir = Plan.from_json(open(sys.argv[1]).read()), sys.argv[2]
ctypes.CDLL("libc.so.6").malloc_trim(0)  # free heap of the bare process is not counted
env = WorkerEnv(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), tp_size=1, pp_size=1,
                plan_file=sys.argv[1], model_dir=model_dir, rendezvous_timeout=60)
worker = Worker.start(env, plan)
out = {"resident": worker.resident.model_dump(), "allocated": worker.allocated}
if worker.stage.device.type == "cuda":  # what torch's allocator held at most, and holds now
    out["cuda_peak"], out["cuda_now"] = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
worker.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16"])
def test_resident_bytes_after_load_are_the_plan(by_dtype, tmp_path, device, stored):
    """A fresh rank (`Worker.start`, one process per runtime dtype: float32, bfloat16, and int8
    with bfloat16 activations) holds its planned weights after load, within 2%: anonymous memory
    on a CPU, what CUDA's caching allocator reserved on a GPU (plus the allocator's segment
    rounding there, up to 22 MiB). On a GPU no conversion temporary ever lived on the device
    (torch's peak allocation is what it holds after load); on a CPU the peak above the bare
    process stays within 1.15x the plan."""
    procs = {}
    for target in ("float32", "bfloat16", "int8"):
        dtype, quantization = ("bfloat16", "int8") if target == "int8" else (target, "none")
        plan = device_plan(by_dtype[stored], device, dtype=dtype, quantization=quantization)
        plan_file = tmp_path / f"{target}.json"
        plan_file.write_text(plan.to_json())
        # one at a time on a small machine; side by side where cores allow (each measures itself)
        procs[target] = (plan, subprocess.Popen(
            [sys.executable, "-c", MEASURE, str(plan_file), str(by_dtype[stored])], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, **LOOPBACK, "OMP_NUM_THREADS": "1"}))
        if (os.cpu_count() or 1) < 8:
            procs[target][1].wait()
    for target, (plan, proc) in procs.items():
        out, err = proc.communicate(timeout=JOB_TIMEOUT)
        assert proc.returncode == 0, err
        measured = json.loads(out.strip().splitlines()[-1])
        predicted = plan.ranks[0].predicted_bytes
        weights = measured["resident"]["weights"]
        print(f"{device} {stored} -> {target}: weights {weights} resident, {predicted.weights} planned "
              f"({weights / predicted.weights - 1:+.2%})")
        assert measured["allocated"]["weights"] == predicted.weights
        slack = CUDA_SEGMENTS if device == "cuda" else 0
        assert abs(weights - predicted.weights) <= 0.02 * predicted.weights + slack, (target, measured, predicted)
        if device == "cuda":
            assert measured["cuda_peak"] - measured["cuda_now"] <= 0.01 * predicted.weights, (target, measured)
        else:
            assert 0 < measured["resident"]["peak"] <= 1.15 * predicted.total, (target, measured, predicted)


# ---------------------------------------------------------------- offload
@pytest.mark.parametrize("fraction, host_memory", [(0.25, None), (1.0, None), (1.0, "1MiB")])
def test_streamed_layers_compute_what_resident_ones_do(pool, deep, reference, device, fraction, host_memory):
    """25% and 100% of the layers streamed give the resident run's float32 logits bit for bit and HF's
    tokens. On a GPU the layers come from pinned host copies, or, past 1 MiB of host memory, from
    the files through each slot's pinned buffer; on a CPU from the files, mapped in place. The rank
    counts whole layers streamed, time spent streaming, and stalls no longer than the generate."""
    kind = kind_of(device)
    resident = generate(pool, streaming_plan(deep, 1, 1, 0.0, kind=kind), deep, [PROMPT])
    plan = streaming_plan(deep, 1, 1, fraction, kind=kind, host_memory=host_memory)
    off = plan.ranks[0].offload
    assert len(off.layers) == fraction * SHAPE["num_layers"]
    if device == "cuda":
        assert off.tier == ("host+files" if host_memory else "host"), off
    results = generate(pool, plan, deep, [PROMPT])
    assert_matches_hf(results, reference(deep, device), [PROMPT])
    assert torch.equal(logits_of(results[0]), logits_of(resident[0])), "logits differ from the resident run"
    report = results[0]["reports"][0]
    per_layer = off.streamed_bytes // len(off.layers)
    assert report["streamed_bytes"] % per_layer == 0
    assert report["streamed_bytes"] >= 5 * off.streamed_bytes  # a forward pass per token at least
    # a GPU copies every streamed layer into its device slots; a CPU computes on the mapped files in place
    assert off.copied_bytes == (off.streamed_bytes if device == "cuda" else 0)
    assert report["allocated_bytes"]["staging"] == plan.rank_plan(0, 0).predicted_bytes.staging \
        == off.prefetch * off.copied_bytes // len(off.layers)
    figures = report["last_generate"]
    print(f"{device} {fraction:.0%} streamed from {off.tier}: {figures['streamed_bytes']} bytes, "
          f"{figures['stream_seconds']:.4f} s streaming, {figures['stall_seconds']:.4f} s stalled on the host, "
          f"{figures['device_stall_seconds']:.4f} s on the device in {figures['seconds']:.4f} s")
    # The generate's own figures are complete at its end: every forward pass's layers (5 at least),
    # less those loaded ahead before it began.
    assert figures["streamed_bytes"] >= 5 * off.streamed_bytes - off.prefetch * per_layer
    assert figures["stream_seconds"] > 0
    assert 0 <= figures["stall_seconds"] <= figures["seconds"]
    assert 0 <= figures["device_stall_seconds"] <= figures["seconds"]
    if device == "cpu":
        assert figures["device_stall_seconds"] == report["device_stall_seconds"] == 0


def test_a_streamer_lends_each_layer_its_weights_and_lets_go_of_everything_on_close(deep, device):
    """One streaming rank's Streamer in this process, both tiers on a GPU (1 MiB of host memory:
    7 of the 24 layers; the others from the files): every borrow, in and out of forward order, gets
    its layer's weights bit for bit; a GPU pins exactly the plan's bytes (one registered arena, no
    power-of-two rounding); the counters of a run of borrows are complete at the snapshot after
    it; and `close`, with copies possibly in flight, waits for them and unpins the arena."""
    from shard_worker.comm.dist import Comm, Topology
    from shard_worker.model.config import ModelConfig
    from shard_worker.model.loader import load_stage
    from shard_worker.model.model import Stage
    from shard_worker.model.offload import Streamer
    from shard_worker.model.slices import Layout
    from shard_worker.telemetry.accounting import Accounting, CudaClock

    off = streaming_plan(deep, 1, 1, 1.0, kind=kind_of(device), host_memory="1MiB").ranks[0].offload
    on = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    config = ModelConfig.from_dir(deep)
    layout = Layout(config, tp=1, tp_rank=0, layers=(0, config.num_layers), embeds=True, has_lm_head=True)
    acct = Accounting(CudaClock() if device == "cuda" else None)
    comm = Comm(Topology(rank=0, tp=1, pp=1), acct)  # no collective runs: no group needed
    whole = Stage(layout, comm, torch.float32, on)
    load_stage(whole, deep)
    stage = Stage(layout, comm, torch.float32, on, streamed=off.layers)
    load_stage(stage, deep)
    streamer = stage.streamer = Streamer(stage, off, deep, acct)
    if device == "cuda":
        assert off.tier == "host+files"
        assert streamer.arena.nbytes == streamer.arena.used == off.host_bytes - off.read_bytes
        assert all(t.is_pinned() for layer in streamer.host.values() for t in layer.values())
        assert all(t.is_pinned() for slot in streamer.slots for t in slot.pinned.values())
    per_layer = off.streamed_bytes // len(off.layers)
    order = [0, 1, 2, 0, 5, 6, 7, 23, 0, 1, 12, 13]
    streamer.start()
    try:
        before = acct.snapshot()
        for j in order:
            with acct.computing(), streamer.lend(stage.layers[j]):
                for name, projection in stage.layers[j].projections().items():
                    weight = projection.weight
                    weight = torch.cat(weight) if isinstance(weight, tuple) else weight  # row blocks
                    assert torch.equal(weight, whole.tensors()[f"layers.{j}.{name}.weight"]), (j, name)
        counted = acct.snapshot().minus(before)
        assert counted.streamed_bytes % per_layer == 0
        assert counted.streamed_bytes >= (len(order) - off.prefetch) * per_layer  # every borrow's copy
        assert counted.stream_seconds > 0 and counted.compute_seconds >= 0 and counted.device_stall_seconds >= 0
        if device == "cpu":
            assert counted.device_stall_seconds == 0
        with streamer.lend(stage.layers[2]):  # out of order again: copies in flight as it closes
            pass
    finally:
        streamer.close()
    if device == "cuda":
        assert streamer.side.query() and streamer.arena.closed


# ---------------------------------------------------------------- shardctl run
@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    """`shardctl demo-model`'s own checkpoint: several files and a real tokenizer."""
    return write_demo_model(tmp_path_factory.mktemp("demo") / "tiny",
                            DemoShape(layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=600,
                                      max_positions=512, files=3))


def test_shardctl_run_serves_a_completion(demo_model, tmp_path, device):
    """`shardctl run --devices localhost:16GiB --device-kind gpu` (or cpu): the plan puts the rank
    on the device, the rank loads there (a rank planned on cuda:0 in a process without CUDA
    refuses to start) and answers a prompt through /v1/completions."""
    yaml_file = tmp_path / "m.yaml"
    yaml_file.write_text(f"""apiVersion: sharding.dev/v1alpha1
kind: ShardedModel
metadata:
  name: tiny
spec:
  model: {{path: {demo_model}, dtype: bfloat16, maxModelLen: 64, maxBatchSize: 2}}
  parallelism: {{tensor: 1, pipeline: 1}}
""")
    proc = shardctl("run", "-f", str(yaml_file), "--port", "0", "--devices", f"localhost:{MEMORY}",
                    "--device-kind", kind_of(device), "--prompt", "the lighthouse keeper", "--max-tokens", "8",
                    "--restarts", "0", "--log-dir", str(tmp_path / "logs"), env={**os.environ, **LOOPBACK})
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"{out}\n{err}"
    assert re.search(rf"^\s+0\s+localhost\s+{device}:0\s", out, re.M), out  # the plan's table
    assert re.search(r"^answer: '.+'$", out, re.M), out
    assert re.search(r"^\(\d+ tokens?, finish_reason (length|stop)\)$", out, re.M), out
    assert "loaded in" in (tmp_path / "logs" / "attempt-0" / "rank-0.log").read_text()
