"""The planner: profile + devices + spec -> Plan. Pure and deterministic.

How it decides, in order:
1. Candidate tensor degrees divide the attention heads, the MLP width and (either way) the KV heads,
   and fit in one node (a TP group never crosses a node: its all-reduces run every layer).
2. Each node's devices, largest first, are cut into TP blocks; a block is as big and as fast as its
   smallest device. For every (TP, PP) each replica takes PP blocks (fastest, roomiest, or all of
   one kind -- whichever gives the shortest decode step) and arranges them into stages.
3. Layers go to stages one at a time, each to the stage that would finish it soonest and still has
   memory for it. Layers are identical work, so this greedy minimises the slowest stage (the
   pipeline's throughput) while every rank fits: a device twice as big and fast gets about twice
   the layers.
4. Among feasible layouts, those that place the most replicas (as many as fit, up to the spec's);
   among them the shortest critical path (one decode step through every stage, collectives and
   hops included); layouts within `tolerance` of it count as ties and the one with fewer devices
   wins.
5. With `maxBatchSize` unset on GPUs, steps 2-4 run for a cap of 256 running rows and, when that
   places fewer groups than one row does, for smaller powers of two: the largest that places as
   many is the plan's (`rowcap.py`; every row costs memory beside the KV cache).
With `spec.placement.offload` (policy auto, when nothing fits otherwise; always) a stage may hold
more layers than its memory by streaming some in at every step (`offload.py`): the same search,
with each stage's time max(compute, streaming) and its layers resident as far as they fit.
Parallelism no pool could ever run (a tensor degree that does not divide the heads, more stages
than layers) is an `InvalidParallelism` PlanError before any device is looked at. When not even
one replica fits, `PlanError` says what stands in the way first (a given layout's device count or
rank size), how much is needed, what the pool has, and what would fit; when some but not all do,
the Plan has fewer groups than `replicas` and `shortfall` says what the others lack. What would
fit is `advice.py`'s: every suggestion was checked by planning again with it applied.
`consider` lists every layout tried (`shardctl plan --explain`).

The modules, each with one job: `request` (the spec resolved, the options, PlanError), `blocks`
(devices cut into tensor-parallel blocks), `sizing` (bytes a rank holds), `costs` (a stage's
memory and time; the layer split), `transport`, `step` and `offload` (what collectives, hops, a
step's launches and streamed layers cost), `rowcap` (an unset maxBatchSize's cap), `search` (the
layouts tried and the one chosen, as a Plan), `explain` and `advice` (why not, and what would
fit), `planner` (the entry point: search, else explain).
Beside them: the planner's inputs, `profile` (the model) and `inventory` (the devices), and
what uses a plan without running anything: `replan` (keep, extend, repair or replace the current
plan), `report` (the plan table, `--explain`) and `picture` (a plan or a shortfall, drawn).

May import: api (tests/contract/test_boundaries.py).
"""

from .costs import Costs, StageModel, partition_layers
from .explain import Shortage, explain_infeasible, shortfall
from .planner import plan
from .request import (
    AUTO_FALLBACK,
    DEFAULT_MAX_MODEL_LEN,
    PlanError,
    PlannerOptions,
    Request,
    Shortfall,
    check_parallelism,
    resolve_request,
)
from .search import Considered, consider, places

__all__ = ["AUTO_FALLBACK", "DEFAULT_MAX_MODEL_LEN", "Considered", "Costs", "PlanError", "PlannerOptions", "Request",
           "Shortage", "Shortfall", "StageModel", "check_parallelism", "consider", "explain_infeasible",
           "partition_layers", "places", "plan", "resolve_request", "shortfall"]
