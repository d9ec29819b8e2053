"""shard_worker.telemetry."""
