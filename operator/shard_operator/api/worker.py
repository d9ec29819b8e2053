"""`spec.worker`: the rank pods' image, resources, environment, ports, secrets, the admin's pod
settings (pull secrets, service account, priority, labels, annotations, host network,
capabilities) and NCCL's."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from .base import ApiModel


class EnvVar(ApiModel):
    name: str = Field(min_length=1)
    value: str = ""


class Resources(ApiModel):
    requests: dict[str, str] = Field(default_factory=dict)
    limits: dict[str, str] = Field(default_factory=dict)

    @field_validator("requests", "limits", mode="before")
    @classmethod
    def _quantities_as_strings(cls, value: Any) -> Any:
        # Kubernetes quantities are int-or-string; keep them as the strings Kubernetes prints.
        if isinstance(value, dict):
            return {k: str(v) for k, v in value.items()}
        return value


class SecretKeyRef(ApiModel):
    name: str = Field(max_length=253, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                      description="A Secret in the model's namespace.")
    key: str = Field(max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="The Secret's key that holds it.")


DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A label or annotation key: an optional DNS-subdomain prefix and "/", then a name of at most 63.
QUALIFIED_NAME = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
OURS = ("sharding.dev/", "app.kubernetes.io/managed-by")  # the operator's own labels and annotations
_NOT_OURS: dict[str, Any] = {  # Any: json_schema_extra's JSON values (a dict[str, str] is not one to mypy)
    "rule": "self.all(k, !k.startsWith('sharding.dev/') && k != 'app.kubernetes.io/managed-by')",
    "message": "sharding.dev/ keys and app.kubernetes.io/managed-by are the operator's"}
# An interface list as NCCL reads NCCL_SOCKET_IFNAME and NCCL_IB_HCA: "^" excludes, "=" matches exactly.
NCCL_LIST = r"^[=^]?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$"


class LocalObjectReference(ApiModel):
    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN, description="A Secret in the model's namespace.")


class Nccl(ApiModel):
    """NCCL settings of GPU ranks, written into their environment (other NCCL_* variables: env)."""

    nvls: bool = Field(False, description=(
        "NVLink SHARP (NCCL_NVLS_ENABLE) on NVSwitch systems. Off by default: its buffers take about 0.3 GiB "
        "per rank per communicator; on, the planner budgets them."))
    socket_ifname: str | None = Field(None, max_length=256, pattern=NCCL_LIST, description=(
        "NCCL_SOCKET_IFNAME: the interfaces NCCL's sockets use (e.g. eth0; ^lo,docker excludes)."))
    ib_hca: str | None = Field(None, max_length=256, pattern=NCCL_LIST, description=(
        "NCCL_IB_HCA: the InfiniBand/RoCE adapters NCCL uses (e.g. mlx5_0,mlx5_1; =mlx5_0 exactly)."))
    debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = Field(None, description="NCCL_DEBUG.")

    def env(self) -> dict[str, str]:
        values = {"NCCL_NVLS_ENABLE": "1" if self.nvls else "0", "NCCL_SOCKET_IFNAME": self.socket_ifname,
                  "NCCL_IB_HCA": self.ib_hca, "NCCL_DEBUG": self.debug}
        return {k: v for k, v in values.items() if v is not None}


class WorkerSpec(ApiModel):
    image: str | None = Field(None, description="Worker image; default: the operator's setting.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    resources: Resources = Field(default_factory=Resources, description=(
        "CPU/memory for each rank, over defaults sized from the plan; a pod of several ranks asks for "
        "their sum, and the GPUs are added."))
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment, e.g. NCCL_SOCKET_IFNAME.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the API and /metrics.")
    rendezvous_port: int = Field(29500, ge=1, le=65535, description="torch.distributed MASTER_PORT.")
    rendezvous_timeout_seconds: int = Field(600, ge=1)
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: NCCL on GPUs, gloo on CPUs.")
    api_key_secret: SecretKeyRef | None = Field(
        None, description="An API key the OpenAI routes require (Authorization: Bearer): mounted from this Secret "
                          "into each group's leader pod, which the operator never reads. Health, readiness, "
                          "metrics and /v1/shards stay open.")
    runtime_class_name: str | None = Field(None, min_length=1, description=(
        "RuntimeClass of the rank pods, e.g. nvidia where the NVIDIA container runtime is not the nodes' "
        "default (the GPU Operator installs one by that name)."))
    # What a cluster admin sets on every rank pod (the profiling pod gets the pull secrets,
    # service account, priority and labels too: it runs the same image on the same nodes).
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16, description=(
        "Secrets (kubernetes.io/dockerconfigjson) the rank pods pull the worker image with: a private registry."))
    service_account_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN, description=(
        "ServiceAccount of the rank pods (workload identity, image pulls); its API token is never mounted: "
        "the workers do not call the Kubernetes API. Default: the namespace's default account."))
    # Keys are checked here (`_keys`), not by the CRD: Kubernetes schemas have no patternProperties,
    # and a regex per key in CEL may exceed the API server's cost budget; the pod's own validation
    # would refuse them too.
    pod_annotations: dict[str, str] = Field(
        default_factory=dict, json_schema_extra={"x-kubernetes-validations": [_NOT_OURS], "maxProperties": 64},
        description=(
            "Annotations of the rank pods, e.g. k8s.v1.cni.cncf.io/networks for a Multus (RDMA) network, "
            "sidecar.istio.io/inject: \"false\"."))
    pod_labels: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]] = Field(
        default_factory=dict, json_schema_extra={"x-kubernetes-validations": [_NOT_OURS], "maxProperties": 64},
        description=(
            "Labels of the rank pods (cost allocation, policies); sharding.dev/ keys are the operator's."))
    priority_class_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN, description=(
        "PriorityClass of the rank pods: what the scheduler may preempt for them, and they for others."))
    host_network: bool = Field(False, description=(
        "Run the rank pods in the node's network namespace (RDMA or NICs that pods cannot reach otherwise). "
        "Their ports are then the node's: each pod serves on port + its first rank, so one group's pods "
        "share a node without a clash; NetworkPolicies do not apply."))
    capabilities: list[Literal["IPC_LOCK"]] = Field(default_factory=list, max_length=1, description=(
        "Linux capabilities added to the worker container (all others are dropped): IPC_LOCK, as RDMA "
        "device plugins ask, to pin memory for InfiniBand/RoCE."))
    nccl: Nccl = Field(default_factory=Nccl, description="NCCL settings of GPU ranks.")

    @field_validator("pod_annotations", "pod_labels")
    @classmethod
    def _keys(cls, values: dict[str, str]) -> dict[str, str]:
        bad = sorted(k for k in values if len(k) > 317 or not re.match(QUALIFIED_NAME, k))
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))}: not a label or annotation key (a name of at most 63 "
                             "letters, digits, '-', '_' or '.', after an optional DNS-subdomain prefix and '/')")
        ours = sorted(k for k in values if k.startswith(OURS))
        if ours:
            raise ValueError(f"{', '.join(ours)}: sharding.dev/ keys and app.kubernetes.io/managed-by are the "
                             "operator's")
        return values
