"""What a decode step costs beyond streaming its weights at the device's read bandwidth and the
collectives' latency (`transport.py`): the constants of the step model, by device kind, in one
place. Pure.

A GPU rank replays one captured graph a step (worker `graphs.py`): the host launches it, the
sampled ids come back in one device-to-host copy, and between the ~15 kernels of a layer the GPU
idles a few microseconds. Its kernels read at a share of the read limit, not all of it. int8
weights halve the bytes, but a GPU only gains where the kernel converts them in registers
(worker `int8mm.py`); until a device has measured a gain, int8 is priced as the bfloat16 layer.

The GPU figures are first estimates, not measurements (no GPU has run the replayed step yet):
bench/gpu_check.sh prints the plan's prediction beside what it measures, and they are to be
calibrated from its runs (docs/benchmarks.md, "On a GPU"). The CPU figures leave the measured
CPU model as it was: its speed is already a measured rate and its C kernels read int8 at the
byte rate. All of them are settable (`PlannerOptions.step`, the operator's `planner_options`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepOverhead:
    # a step's fixed cost on each rank: graph launch, sampling on the device, the copy of the ids
    per_step: dict[str, float] = field(default_factory=lambda: {"gpu": 60e-6, "cpu": 0.0})
    # a layer's kernels' gaps inside a replayed graph
    per_layer: dict[str, float] = field(default_factory=lambda: {"gpu": 6e-6, "cpu": 0.0})
    # the share of the read bandwidth a decode step's kernels reach
    read_share: dict[str, float] = field(default_factory=lambda: {"gpu": 0.75, "cpu": 1.0})
    # int8 decoder layers: at most this many times faster than the same layers in bfloat16 (and
    # never faster than their bytes allow); 1.0: no gain claimed
    int8_speedup: dict[str, float] = field(default_factory=lambda: {"gpu": 1.0, "cpu": 2.0})

    def layer_seconds(self, kind: str, layer_bytes: int, unquantized_bytes: int, bandwidth: float) -> float:
        """One decoder layer's time: its bytes (and, quantized, its unquantized bytes over the
        measured int8 gain: the slower) at the read share, plus its kernels' gaps."""
        rate = bandwidth * self.read_share[kind]
        read = max(layer_bytes, unquantized_bytes / self.int8_speedup[kind]) / rate
        return read + self.per_layer[kind]

    def fixed_seconds(self, kind: str, fixed_bytes: int, bandwidth: float) -> float:
        """The rest of a stage's step: embeddings, final norm and LM head read, and the step's own cost."""
        return fixed_bytes / (bandwidth * self.read_share[kind]) + self.per_step[kind]
