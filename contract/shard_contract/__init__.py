"""The contract between shard-operator's control plane and its workers: the Plan, the worker's
environment, the HTTP wire types, checkpoint reading, the sharding rules and byte units.

Torch-free and free of any Kubernetes client: both planes import it, it imports neither.
"""
