"""shard_worker.serving."""
