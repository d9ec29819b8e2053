"""What a prompt chunk adds to a step of a continuous batch, on the serving bench's model and cores:
the measurement behind a CPU's per-step token budget (contract sharding.STEP_TOKENS["cpu"]).

One rank as bench/serve_peer.py serves it: the demo model (DemoShape, float32, written by
`write_demo_model` into .cache/demo-model if it is not there), TP=1 with 2 threads, maxModelLen
2048, maxBatchSize 64, the environment `python -m shard_worker` sets (OMP_WAIT_POLICY=PASSIVE,
huge pages, the GC frozen after load); built in this process by `Worker.start` and driven through
the engine's hooks as the server's batcher drives it (no HTTP: the engine's step alone).

For each number of decoding streams k (`--decodes`, default 1, 8 and 63: one stream, the serve
bench's scenario 2 of 8 short streams, and a full batch of 64 rows with the joiner's) and each
chunk size n (8, 16, 32, 64, 128, 256), one continuous generate: k streams decode alone for a
while, then a prompt of 1900 tokens (scenario 2's long prompt; random tokens, another each time, so
the prefix cache never has it) joins and is computed n tokens a step, beside the k decodes, until
its last chunk emits its first token. The engine's budget is set so that the prompt's share of a
step is exactly n (`budget_for`). Each step is timed from one step's tokens to the next: the
engine's whole step (orders, chunk, decode). A round runs every (k, n) once, every other round in
the reverse order (ABBA), so a drift of the machine's load touches every pair alike.

Reported per (k, n), as the median over rounds: the median step with a chunk over the median step
without (the same generate's steps before the prompt arrived: the same k decodes, the same
minute), over all its chunks and over the deepest tenth of its full chunks (the latest positions:
each chunk attends to every earlier prompt position, so these steps are the longest, and the serve
bench's goal is about the longest gap a stream sees); and the step without a chunk, in ms. The
load average and this process's nice value are printed with each round.

    nice .venv/bin/python bench/step_budget.py [--decodes 1,8,63] [--chunks 8,16,32,64,128,256]
                                               [--rounds 4] [--prompt 1900] [--threads 2] [--out FILE.json]
    .venv/bin/python bench/step_budget.py --quick     # a smoke run of the script (tiny model, 1 round)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LEN = 2048
MAX_BATCH = 64
STREAM_PROMPT = 16  # each short stream's prompt (tokens)
ALONE_STEPS = 16  # steps the streams decode before the prompt joins (the first is left out)


def budget_for(chunk: int, decodes: int) -> int:
    """The step budget whose prompt share beside `decodes` decoding rows is `chunk` tokens
    (engine/chunking.py's `prompt_tokens`: the budget less the decodes, at least half the budget)."""
    return decodes + chunk if chunk >= decodes else 2 * chunk


def set_rank_environment(threads: int) -> None:
    """What the launcher and `python -m shard_worker` set for a rank, before torch is imported."""
    os.environ.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                       "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"})
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def start_worker(model_dir: Path, max_batch: int):
    from shard_contract.env import WorkerEnv
    from shard_operator.local.launcher import free_port, plan_local
    from shard_worker.rank.runtime import Worker, freeze_loaded_objects

    plan = plan_local(model_dir, 1, 1, max_model_len=MAX_LEN, max_batch_size=max_batch, devices="localhost:16GiB",
                      device_kind="cpu")
    env = WorkerEnv(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), tp_size=1, pp_size=1,
                    plan_file="(in memory)", model_dir=str(model_dir), rendezvous_timeout=60)
    worker = Worker.start(env, plan)
    freeze_loaded_objects()
    return worker


def one_generate(engine, decodes: int, chunk: int, prompt: int, vocab: int, rng: random.Random) -> dict:
    """k streams decode alone for ALONE_STEPS steps, then a `prompt`-token request joins and is
    computed `chunk` tokens a step beside them. Returns the steps' seconds: those without a chunk
    (but the first), those with one, and those of the deepest tenth of the full chunks."""
    from shard_contract.wire import GenerateRequest
    from shard_worker.engine.boundary import Hooks

    chunks = -(-prompt // chunk)
    streams = [GenerateRequest(prompt_ids=[rng.randrange(3, vocab) for _ in range(STREAM_PROMPT)],
                               max_new_tokens=ALONE_STEPS + chunks + 3, ignore_eos=True) for _ in range(decodes)]
    joiner = GenerateRequest(prompt_ids=[rng.randrange(3, vocab) for _ in range(prompt)], max_new_tokens=1,
                             ignore_eos=True)
    boundary = [0]
    stamps: list[tuple[float, list[int]]] = []

    def admit(free_rows: int, col: int) -> list:
        boundary[0] += 1
        return [joiner] if boundary[0] == ALONE_STEPS + 1 else []

    def step(seqs) -> None:
        stamps.append((time.perf_counter(), [s.index for s in seqs]))

    engine.step_tokens = budget_for(chunk, decodes)
    engine.generate(streams, hooks=Hooks(admit=admit, step=step, finished=lambda seq, done: None))
    seconds = [b - a for (a, _), (b, _) in itertools.pairwise(stamps)]  # seconds[j - 1]: step j
    first = next(j for j, (_, indices) in enumerate(stamps) if decodes in indices)  # the joiner's first token
    joined = ALONE_STEPS + 1  # the step that computed its first chunk
    assert first - joined + 1 == chunks, (first, joined, chunks)
    with_chunk = seconds[joined - 1:first]
    full = with_chunk[:prompt // chunk] or with_chunk  # the steps whose chunk is n tokens (the last may be fewer)
    return {"alone": seconds[1:ALONE_STEPS], "chunk": with_chunk, "deep": full[-max(1, len(full) // 10):]}


def loadavg() -> float:
    return os.getloadavg()[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decodes", default="1,8,63")
    parser.add_argument("--chunks", default="8,16,32,64,128,256")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=1900)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, help="model directory (default: the demo model in .cache/)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a 2-layer model, 1 round, short prompt")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    set_rank_environment(args.threads)
    from shard_operator.local.demo_model import DemoShape, write_demo_model

    decodes = [int(k) for k in args.decodes.split(",")]
    sizes = [int(n) for n in args.chunks.split(",")]
    scratch = tempfile.TemporaryDirectory()
    if args.quick:
        args.rounds, args.prompt = 1, 200
        model_dir = write_demo_model(Path(scratch.name) / "tiny", DemoShape(layers=2, hidden=128, intermediate=256,
                                                                             heads=4, kv_heads=2))
    else:
        model_dir = args.model or REPO / ".cache" / "demo-model"
        if not (model_dir / "config.json").is_file():
            write_demo_model(model_dir, DemoShape(), overwrite=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    print(f"model {model_dir}, {args.threads} threads, nice {os.nice(0)}, load {loadavg():.2f}", flush=True)
    started = time.perf_counter()
    worker = start_worker(model_dir, max(MAX_BATCH, max(decodes) + 1))
    print(f"loaded and warmed up in {time.perf_counter() - started:.0f} s", flush=True)
    rng = random.Random(0)
    pairs = [(k, n) for k in decodes for n in sizes]
    runs: dict[str, list[dict]] = {f"{k},{n}": [] for k, n in pairs}
    loads = []
    try:
        one_generate(worker.engine, decodes[0], sizes[-1], args.prompt, vocab, rng)  # warm: the kernels' shapes
        for r in range(args.rounds):
            before = loadavg()
            for k, n in (pairs if r % 2 == 0 else pairs[::-1]):  # ABBA: a drift of the load cancels
                got = one_generate(worker.engine, k, n, args.prompt, vocab, rng)
                alone = statistics.median(got["alone"])
                runs[f"{k},{n}"].append({"alone_s": alone, "chunk": statistics.median(got["chunk"]) / alone,
                                         "deep": statistics.median(got["deep"]) / alone})
            loads.append((before, loadavg()))
            print(f"round {r + 1}/{args.rounds}: load {before:.2f} -> {loads[-1][1]:.2f}", flush=True)
    finally:
        worker.close()
    table = {}
    lines = ["| decodes k | chunk n | budget | step with chunk / without: median | deepest tenth | "
             "step without (ms) |", "|---|---|---|---|---|---|"]
    for k, n in pairs:
        got = runs[f"{k},{n}"]
        row = {key: statistics.median(g[key] for g in got) for key in ("alone_s", "chunk", "deep")}
        table[f"{k},{n}"] = {**row, "budget": budget_for(n, k), "rounds": got}
        lines.append(f"| {k} | {n} | {budget_for(n, k)} | {row['chunk']:.2f} | {row['deep']:.2f} | "
                     f"{1e3 * row['alone_s']:.1f} |")
    print("\n".join(lines))
    print(f"load average (1 min) before -> after each round: {', '.join(f'{a:.2f}->{b:.2f}' for a, b in loads)}")
    if args.out:
        args.out.write_text(json.dumps({"prompt": args.prompt, "threads": args.threads, "loads": loads,
                                        "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
