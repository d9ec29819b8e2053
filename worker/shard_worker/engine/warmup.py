"""The warm-up pass a rank runs before it says ready: its largest forward pass, measured.

A rank's peak memory is its weights and KV cache plus the activations of its largest forward pass:
the rows a prefill pass computes together (`sharding.prefill_rows`: maxBatchSize, at most
MAX_STEP_TOKENS of prefill chunks) by one prefill chunk, attending to the whole context (the last
chunk of a maxModelLen prompt: its mask and, for GQA under a mask, K/V expanded to the query heads,
are the largest). What up to maxBatchSize decoding rows cost beyond it (a GPU rank's captured
decode steps, the sampler's working set) is the planner's estimate, not measured here. Without a
warm-up that peak is first met under the first big load, where an out-of-memory kills the group
while it serves; with it, a plan whose activations do not fit fails at start, with a reason that
names the plan's numbers, and the peak it reached is part of what the rank reports
(`ResidentBytes.activations`, and `peak`).

Every rank of a stage runs the same pass on made-up input (token ids on the first stage, zeros
elsewhere), so the tensor-parallel all-reduces inside it meet; stages do not talk to each other.
What it wrote into the KV cache is zeroed afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shard_contract.sharding import PREFILL_CHUNK

from ..model.model import Stage
from ..model.step import KVCache, Rotary, Step
from ..telemetry.accounting import proc_status


class WarmupOutOfMemory(MemoryError):
    """The plan's largest forward pass does not fit this rank's device."""


@dataclass(frozen=True)
class Warmup:
    rows: int
    cols: int
    activations: int  # bytes above what the rank held before the pass, at its peak


def largest_pass(rows: int, max_len: int, chunk: int = PREFILL_CHUNK) -> tuple[int, int, int]:
    """Rows, first and end column of the plan's largest forward pass: `rows` (the rows of a
    prefill pass), the last chunk."""
    cols = min(max_len, chunk)
    return rows, max_len - cols, max_len


def warm_up(stage: Stage, cache: KVCache, rotary: Rotary, rows: int, max_len: int,
            chunk: int = PREFILL_CHUNK) -> Warmup:
    """The largest prefill pass of `rows` rows (at most the cache's) at maxModelLen, measured."""
    rows, c0, c1 = largest_pass(rows, max_len, chunk)
    device, cuda = stage.device, stage.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = reset_peak_rss()
    pads = torch.zeros(rows, dtype=torch.int64)
    try:
        with torch.inference_mode():
            if stage.embed is not None:
                x = torch.randint(0, stage.config.vocab_size, (rows, c1 - c0), device=device)
            else:
                x = torch.zeros(rows, c1 - c0, stage.config.hidden_size, dtype=stage.dtype, device=device)
            step = Step.build(0, rows, c0, c1, pads, rotary, stage.windows, stage.dtype, device)
            hidden = stage.forward(x, step, cache)
            if stage.lm_head is not None:
                stage.logits(hidden[:, -1])
            del x, hidden, step
            if cuda:
                torch.cuda.synchronize(device)
    except torch.cuda.OutOfMemoryError as err:
        raise WarmupOutOfMemory(
            f"the warm-up pass at the plan's largest forward pass ({rows} rows x {c1 - c0} prefill "
            f"tokens attending to {c1} positions, maxModelLen) ran out of device memory: the plan's activations "
            f"do not fit beside its weights and KV cache; lower maxBatchSize or maxModelLen, or raise "
            f"memoryHeadroom ({str(err).splitlines()[0]})") from None
    finally:
        cache.k.zero_()
        cache.v.zero_()
    peak = torch.cuda.max_memory_allocated(device) if cuda else proc_status()["VmHWM"]
    return Warmup(rows, c1 - c0, max(0, peak - before))


def reset_peak_rss() -> int:
    """Start the process's peak resident set (VmHWM) over from now (Linux's clear_refs "5"), so it
    measures the pass alone; returns the resident set now. Where that is refused, the peak keeps
    the load's and the pass's figure is an upper bound."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    return proc_status()["VmRSS"]
