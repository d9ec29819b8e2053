"""Two ranks on one device: tensor parallel 2 and pipeline parallel 2 as two worker processes that
share it, gloo as their communicator, against one rank: the same greedy tokens, and logits equal
within float32 rounding. NCCL refuses two ranks on one GPU, so on a machine with one GPU this is
how the multi-rank CUDA code (the sharded layers, the collectives on CUDA tensors, the pipeline's
sends staged through the host as gloo needs) runs at all (bench/gpu_check.sh).

    python bench/gpu_ranks.py [--device cuda|cpu] [--model-dir DIR] [--out FILE.json] [--timeout S]

Each layout runs as its own processes (rank 0 generates a batch of two prompts, 8 new tokens, float32,
and writes its logits; rank 1 follows); --out is rewritten after each layout. --timeout bounds the
three together: each layout may take what the ones before it left (the first, the reference, pays
for the cold compiles), and one that would start with under MIN_LAYOUT_SECONDS left is not run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode
import gpu_decode

LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tensor, pipeline); the first is the reference
SHAPE = gpu_decode.SHAPES["tiny"]
PROMPTS = [[(5 * i + 1) % SHAPE["vocab_size"] for i in range(12)],
           [(3 * i + 7) % SHAPE["vocab_size"] for i in range(5)]]
NEW_TOKENS = 8
MAX_LEN = 64
LOGITS_TOLERANCE = 1e-4  # of the logits' largest magnitude: float32 sums in another order
MIN_LAYOUT_SECONDS = 5.0


def child(rank: int, tp: int, pp: int, port: int, plan_file: str, model_dir: str, out: str) -> None:
    """One rank: rank 0 generates and writes tokens and logits to `out`; the others follow."""
    os.environ.update({k: v for k, v in gpu_decode.LOOPBACK.items() if k not in os.environ})
    from safetensors.torch import save_file

    from shard_contract.env import WorkerEnv
    from shard_contract.plan import Plan
    from shard_contract.wire import GenerateRequest
    from shard_worker.rank.runtime import Worker

    # every rank on the one device (local rank 0), gloo for the tensors too
    env = WorkerEnv(rank=rank, world_size=tp * pp, local_rank=0, master_addr="127.0.0.1", master_port=port,
                    tp_size=tp, pp_size=pp, backend="gloo", plan_file=plan_file, model_dir=model_dir,
                    rendezvous_timeout=60)
    worker = Worker.start(env, Plan.from_json(Path(plan_file).read_text()))
    try:
        if rank == 0:
            result = worker.engine.generate([GenerateRequest(prompt_ids=p, max_new_tokens=NEW_TOKENS)
                                             for p in PROMPTS], return_logits=True)
            worker.engine.shutdown()
            import torch

            save_file({"logits": torch.stack([t.float().cpu() for t in result.logits])}, out)
            Path(out + ".json").write_text(json.dumps({
                "tokens": [c.token_ids for c in result.completions], "device": str(worker.stage.device),
                "backend": "gloo"}))
        else:
            worker.engine.follow()
    finally:
        worker.close()


def run_layout(device: str, model_dir: str, tp: int, pp: int, work: Path, timeout: float) -> dict:
    from safetensors.torch import load_file

    from shard_operator.local.launcher import free_port, plan_local
    from shard_operator.planning.profile import profile_model

    world = tp * pp
    # the KV cache the batch needs (not 0.9 of each rank's 16 GiB: two ranks share the one card)
    kv = gpu_decode.kv_memory(profile_model(model_dir).kv_bytes_per_token("float32"), len(PROMPTS), MAX_LEN)
    plan = plan_local(model_dir, tp, pp, dtype="float32", max_model_len=MAX_LEN, max_batch_size=len(PROMPTS),
                      devices=f"localhost:16GiB*{world}", device_kind="gpu" if device == "cuda" else "cpu",
                      kv_cache_memory=kv)
    plan_file, out = work / f"plan-{tp}x{pp}.json", work / f"logits-{tp}x{pp}.safetensors"
    plan_file.write_text(plan.to_json())
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(r), str(tp), str(pp), str(port),
                               str(plan_file), model_dir, str(out)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline = time.monotonic() + timeout
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"TP={tp} PP={pp}: not done within {timeout:.0f} s") from None
    if any(p.returncode for p in procs):
        tail = "\n".join(f"rank {r} (exit {p.returncode}):\n{log[-1500:]}" for r, (p, log) in
                         enumerate(zip(procs, logs, strict=True)) if p.returncode)
        raise RuntimeError(f"TP={tp} PP={pp} failed:\n{tail}")
    return {**json.loads(Path(str(out) + ".json").read_text()), "logits": load_file(str(out))["logits"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model-dir", type=Path, default=decode.CACHE / "bench-gpu-ranks")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--timeout", type=float, default=180, help="seconds the three layouts may take")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        r, tp, pp, port = (int(v) for v in args.child[:4])
        child(r, tp, pp, port, *args.child[4:])
        return 0

    model_dir = str(decode.ensure_checkpoint(args.model_dir, SHAPE, dtype="float32"))
    work = args.model_dir.parent / "gpu-ranks-work"
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": args.device, "shape": SHAPE, "layouts": {}, "errors": []}
    reference = None
    deadline = time.monotonic() + args.timeout
    for tp, pp in LAYOUTS:
        name = f"TP={tp} PP={pp}"
        started = time.perf_counter()
        left = deadline - time.monotonic()
        try:
            if left < MIN_LAYOUT_SECONDS:
                raise RuntimeError(f"{name}: not run, out of time ({left:.0f} s left)")
            got = run_layout(args.device, model_dir, tp, pp, work, left)
        except Exception as err:  # noqa: BLE001 -- one failed layout must not lose the others
            report["layouts"][name] = {"error": str(err)[-2000:]}
            report["errors"].append(f"{name}: {str(err).splitlines()[0]}")
        else:
            entry = {"tokens": got["tokens"], "device": got["device"], "seconds": time.perf_counter() - started}
            if reference is None:
                reference = got
            else:
                scale = float(reference["logits"].abs().max())
                error = float((got["logits"] - reference["logits"]).abs().max()) / scale
                entry.update(same_tokens=got["tokens"] == reference["tokens"], logits_error=error,
                             equal=got["tokens"] == reference["tokens"] and error <= LOGITS_TOLERANCE)
                if not entry["equal"]:
                    report["errors"].append(f"{name}: differs from TP=1 (tokens equal: {entry['same_tokens']}, "
                                            f"logits error {error:.2e} of their largest)")
            report["layouts"][name] = entry
        print(f"{name}: {json.dumps(report['layouts'][name])}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))
    if reference is None:
        report["errors"].append("no reference: TP=1 failed")
    print("two ranks on one device:", "equal to one rank" if not report["errors"] else "; ".join(report["errors"]))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
