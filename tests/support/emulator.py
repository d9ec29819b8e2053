"""The emulated Kubernetes API server now ships in the package (`shardctl dev-cluster` runs it);
this import path stays for the tests and benchmarks that use it."""

from shard_operator.devcluster.emulator import *  # noqa: F401,F403
from shard_operator.devcluster.emulator import ApiError, FidelityEmulator  # noqa: F401
