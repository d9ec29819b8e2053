"""The running-row cap (maxBatchSize) when the spec leaves it out on GPUs: the largest power of two
up to the default (256, vLLM's max_num_seqs) whose rows' costs still let a layout fit. Pure.

Running rows are not free beside the KV cache (the sampler's working set over their logits, the
captured decode steps' outputs, the block masks: `sizing.running_bytes`, `sizing.mask_bytes`), and
every cost grows with the cap, so a smaller cap never fits less. A layout fits when each rank still
holds one maxModelLen sequence of KV in the share of its free memory the cache takes
(`kvcache.fit_tokens`). So the default never makes a model infeasible that one row would run: the
planner takes the largest cap that places as many groups as one row places, without streaming
layers where one row needs none. A cap the spec gives is taken as given (it fits or the plan
refuses, and the refusal's suggestions say which caps would fit).
"""

from __future__ import annotations

from collections.abc import Callable

from shard_contract.units import human

from .request import Request

# (groups placed, whether without streaming layers that it need not stream): higher is better
Score = tuple[int, bool]


def caps(request: Request) -> list[int]:
    """The caps worth trying, largest first: the given one alone, else the default of the pool's
    kind and every smaller power of two down to one."""
    if not request.rows_chosen:
        return [request.batch]
    out, cap = [], request.batch
    while cap >= 1:
        out.append(cap)
        cap //= 2
    return out


def choose(options: list[int], score: Callable[[int], Score], wanted: int) -> int:
    """The largest of `options` (largest first) that scores as well as the smallest does (the
    smallest costs least, so none scores better), trying as few as it can: the largest first,
    which answers for a model that fits with room to spare. When even the smallest places no
    group, the smallest: the one the refusal speaks of."""
    first = score(options[0])
    if len(options) == 1 or first >= (wanted, True):
        return options[0]
    best = score(options[-1])
    if first >= best and first[0] > 0:
        return options[0]
    if best[0] == 0:
        return options[-1]
    return next((cap for cap in options[1:-1] if score(cap) >= best), options[-1])


def explain(cap: int, default: int, max_len: int, larger: Score | None, running: int) -> str:
    """Why the plan runs `cap` rows, for its reason: '' at the default; else what the next larger
    cap (`larger`, its score) would not do. `running`: what the cap's rows cost its most loaded rank."""
    if cap >= default:
        return ""
    if larger is None or larger[0] == 0:
        why = "not one group fits"
    elif not larger[1]:
        why = "layers would stream"
    else:
        why = f"fewer groups fit ({larger[0]})"
    return (f"maxBatchSize {cap}, not the GPU default {default} (spec.model.maxBatchSize is unset): the largest "
            f"power of two whose running rows (the sampler, the captured decode steps, the block masks: "
            f"{human(running)} on the most loaded rank) leave each rank's KV cache room for a sequence of "
            f"{max_len} tokens; at {2 * cap} {why}")
