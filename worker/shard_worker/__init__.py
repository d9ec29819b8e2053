"""shard-operator data plane: torch shard executors that load only their own slices and serve."""

__version__ = "0.1.0"
