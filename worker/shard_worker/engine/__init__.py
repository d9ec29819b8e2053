"""shard_worker.engine."""
