"""shard-operator control plane: API types, profiler, inventory, planner, manifests, operator, CLI.

Never imports torch: the planner must run where the weights are not.
"""

__version__ = "0.1.0"
