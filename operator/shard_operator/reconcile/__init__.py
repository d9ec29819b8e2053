"""The operator's control loop: one reconcile per ShardedModel (`core.py`, values in, a Result
out) and its steps: keep or re-plan (`planning.replan`), the rollout decision (`rollout.py`), the
status (`status.py`), the timing rules (`timing.py`); and its edges: the writes (`writes.py`), the
Events (`events.py`), GPUs held on each node (`capacity.py`), cached profiles (`profiles.py`), the
leaders' `/v1/shards` (`leaders.py`) and the kopf handlers that run it (`handlers.py`).

May import: api, planning, objects, kube, policy, settings (tests/contract/test_boundaries.py)."""
