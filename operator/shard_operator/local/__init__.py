"""`shardctl run` and `shardctl generate` on one machine: the launcher of a group's rank processes
(`launcher.py`), the serve loop with its load progress and status table (`run.py`), a one-shot
generation (`generate.py`), and the demo model (`demo_model.py`). No Kubernetes.

May import: api, planning (tests/contract/test_boundaries.py)."""
