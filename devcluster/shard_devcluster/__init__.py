"""A Kubernetes cluster on one machine, for trying the operator without one and for the end-to-end
tests: an emulated API server, a kubelet that runs every Pod's command as a local process, a
simulated cluster network (pod IPs, DNS names, Service IPs) and the real operator.

`shardctl dev-cluster` starts it. Needs the `devcluster` extra (kmock); importing this package
imports nothing, so the operator image, which lacks kmock, is unaffected.
"""
