"""The device check (bench/gpu_check.sh) runs its whole flow in its dry mode on the CPU: every step
passes, and what it measured is in its files -- decode rows with the planner's prediction beside
the measured step, HF's peer, int8, and two ranks on one device equal to one -- and its test steps
select the CUDA tests a device runs (collected here: a CPU would skip them)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
BOUND = 1800  # seconds: a generous bound on a busy machine, not a measurement


def test_the_dry_run_passes_every_step_and_keeps_its_figures(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(out), "PYTHON": sys.executable,
           "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=BOUND)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, f"{summary}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    steps = summary.splitlines()[1:]
    assert [line.split()[0] for line in steps] == ["ok"] * 7, summary
    assert "(cpu)" in summary.splitlines()[0]
    # the device's selection (-m cuda, SHARD_TEST_DEVICES=cuda), and nothing the CPU runs anyway
    graphs = (out / "tests-graphs.log").read_text()
    for test in ("test_cuda_graph_replay_equals_eager_token_for_token[llama]", "test_cuda_replay_does_not_synchronise",
                 "test_the_compiled_step_reads_in_place_what_the_eager_step_gathers[cuda]",
                 "test_the_steps_host_copy_lands_in_pinned_memory"):
        assert f"test_decode_graphs.py::{test}" in graphs, graphs
    assert "[cpu]" not in graphs and "test_buckets" not in graphs
    device = (out / "tests-device.log").read_text()
    assert "test_float32_matches_hf_on_the_same_device[llama-cuda]" in device and "cpu]" not in device, device

    for model in ("tiny", "tiny-8b"):
        report = json.loads((out / f"gpu_bench-{model}.json").read_text())
        assert report["errors"] == [] and report["bandwidth"]["gb_per_s"] > 0
        rows = {(r["variant"], r["batch"]): r for r in report["rows"]}
        assert set(rows) == {(v, b) for v in ("bfloat16", "int8 compiled") for b in (1, 2)}
        for row in rows.values():
            assert row["measured_ms"] > 0 and row["predicted_ms"] > 0 and 0 < row["share_of_limit"]
        # greedy from the same prompt: HF's peer ran and gives our tokens (its figure is a difference
        # of two timings of 4 and 1 tokens, which a busy CPU can make negative: not asserted)
        assert math.isfinite(rows[("bfloat16", 1)]["hf_tokens_per_s"])
        assert rows[("bfloat16", 1)]["same_first_tokens"] == 4
        assert report["results"]["int8 compiled"]["bytes"] < report["results"]["bfloat16"]["bytes"]

    ranks = json.loads((out / "ranks.json").read_text())
    assert ranks["errors"] == []
    for layout in ("TP=2 PP=1", "TP=1 PP=2"):
        assert ranks["layouts"][layout]["equal"] is True
    assert "decode bench, tiny-8b model" in (out / "check.log").read_text()
