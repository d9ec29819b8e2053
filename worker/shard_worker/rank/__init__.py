"""shard_worker.rank."""
