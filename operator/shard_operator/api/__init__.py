"""The ShardedModel API (`sharding.dev/v1alpha1`): spec and status as pydantic models, one module
per part of the spec.

These models are the single source of the CRD (`crd.py` generates `crds/shardedmodels.yaml` from
them) and of validation messages. Field names are the Kubernetes ones (camelCase) on the wire and
snake_case in Python. `base` (names, conventions, shared types), `model` (spec.model), `placement`
(spec.parallelism, spec.placement, spec.rollout), `worker` (spec.worker), `serving` (spec.serving:
the KV cache's memory), `status`, and `spec`
(the whole object, and parsing a YAML file or an API object into one).
"""

from .base import (
    API_VERSION,
    GROUP,
    KIND,
    NO_DOTDOT,
    PHASES,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    ApiModel,
    Auto,
    Degree,
    Dtype,
    Phase,
    Quantization,
    SpecError,
    normal_path,
    to_snake,
)
from .model import HostPathSource, ImageSource, ModelSpec, ModelVolume, PvcSource, inside, resolve_model_dir
from .placement import Offload, Parallelism, Placement, Rollout, Toleration, Topology
from .serving import DEFAULT_GPU_FRACTION, Serving
from .spec import (
    OFFLOAD_INT8,
    ObjectMeta,
    ShardedModel,
    ShardedModelSpec,
    explain,
    load_sharded_models,
    parse_sharded_model,
    parse_spec,
)
from .status import (
    Condition,
    GroupStatus,
    PlanSummary,
    ShardedModelStatus,
    ShardOffload,
    ShardStatus,
    StageStatus,
)
from .worker import (
    DNS_SUBDOMAIN,
    LABEL_VALUE,
    NCCL_LIST,
    OURS,
    QUALIFIED_NAME,
    EnvVar,
    LocalObjectReference,
    Nccl,
    Resources,
    SecretKeyRef,
    WorkerSpec,
)

__all__ = [
    "API_VERSION", "DEFAULT_GPU_FRACTION", "DNS_SUBDOMAIN",
    "GROUP", "KIND", "LABEL_VALUE", "NCCL_LIST", "NO_DOTDOT", "OFFLOAD_INT8", "OURS",
    "PHASES", "PLURAL", "QUALIFIED_NAME", "SHORT_NAMES", "SINGULAR", "VERSION", "ApiModel", "Auto", "Condition",
    "Degree", "Dtype", "EnvVar", "GroupStatus", "HostPathSource", "ImageSource", "LocalObjectReference",
    "ModelSpec", "ModelVolume", "Nccl", "ObjectMeta", "Offload", "Parallelism", "Phase", "Placement",
    "PlanSummary", "PvcSource", "Quantization", "Resources", "Rollout", "SecretKeyRef", "Serving", "ShardOffload",
    "ShardStatus", "ShardedModel", "ShardedModelSpec", "ShardedModelStatus", "SpecError", "StageStatus",
    "Toleration", "Topology", "WorkerSpec", "explain", "inside", "load_sharded_models", "normal_path",
    "parse_sharded_model", "parse_spec", "resolve_model_dir", "to_snake",
]
