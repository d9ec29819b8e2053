"""shard_worker.model."""
