"""`shardctl generate`: the prompt in, the generated tokens and a per-rank table out. Torch-free
(the ranks are separate processes; see `local.py`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shard_contract.plan import describe_layers
from shard_contract.units import table_unit
from shard_contract.wire import GenerateResult


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: write token ids separated by commas, e.g. 1,2,3") from None
    if not ids:
        raise ValueError("--prompt-ids: give at least one token id")
    return ids


def tokenize(model_dir: str | os.PathLike[str], text: str) -> list[int]:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"--prompt needs {path}; without a tokenizer give --prompt-ids")
    from tokenizers import Tokenizer  # torch-free; only needed here

    ids = Tokenizer.from_file(str(path)).encode(text).ids
    if not ids:
        raise ValueError(f"--prompt {text!r} encodes to no tokens")
    return ids


def result_json(result: GenerateResult) -> dict[str, Any]:
    """The documented `--json` form: token_ids (generated only), text, ranks, timings."""
    done = result.completions[0]
    decode_rate = result.decode_steps / result.decode_seconds if result.decode_seconds > 0 else None
    return {"token_ids": done.token_ids, "text": done.text, "finish_reason": done.finish_reason,
            "prefill_seconds": result.prefill_seconds, "decode_seconds": result.decode_seconds,
            "decode_tokens_per_second": decode_rate,
            "ranks": [r.model_dump(mode="json") for r in result.ranks]}


def render_result(result: GenerateResult) -> str:
    done = result.completions[0]
    rate = f", decode {result.decode_steps / result.decode_seconds:.1f} tokens/s" if result.decode_seconds > 0 else ""
    lines = [f"generated {len(done.token_ids)} tokens ({done.finish_reason}): "
             f"prefill {result.prefill_seconds:.3f} s{rate}",
             "token ids: " + " ".join(map(str, done.token_ids))]
    if done.text is not None:
        lines.append(f"text: {done.text!r}")
    if done.error is not None:
        lines.append(f"error: {done.error}")
    unit, size = table_unit(max((r.plan.predicted_bytes.weights + r.plan.predicted_bytes.kv_cache
                                 for r in result.ranks), default=0))
    header = ("rank", "stage", "tp", "layers", f"predicted {unit}", f"resident {unit}", "load s", "comm s",
              "compute s", "idle s")
    rows = [header]
    for r in result.ranks:
        rp, report = r.plan, r.report
        if report is None:  # a task's every rank reports; a missing one is no row
            continue
        resident = report.resident_bytes.weights + report.resident_bytes.kv_cache
        predicted = rp.predicted_bytes.weights + rp.predicted_bytes.kv_cache
        rows.append((str(rp.rank), str(rp.stage), str(rp.tp_rank), describe_layers(rp.layers),
                     f"{predicted / size:.2f}", f"{resident / size:.2f}", f"{report.load_seconds:.2f}",
                     f"{report.comm_seconds:.3f}", f"{report.compute_seconds:.3f}", f"{report.idle_seconds:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines.append("")
    lines.append("weights + KV cache per rank, predicted by the plan and measured resident:")
    lines.extend("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in rows)
    return "\n".join(lines)
