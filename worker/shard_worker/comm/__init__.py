"""shard_worker.comm."""
