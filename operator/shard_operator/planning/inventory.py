"""Devices the planner may use: from Kubernetes Nodes, a compact string, or the local machine.

A device is one GPU (or one CPU rank budget on a laptop). Its `speed` is its memory bandwidth in
TB/s, because decoding reads every weight once per token: a device twice as fast streams its layers
in half the time. Known GPU products get their datasheet bandwidth; anything else gets 1.0 unless
the node says otherwise (label `sharding.dev/gpu-speed`).

Two more rates matter when layers are streamed (offload): copies from host memory into a GPU
(`host_gbps`: PCIe) and reads of the checkpoint files (`file_gbps`), in GB/s: a GPU rank copies
what it reads, a CPU rank maps the files and computes on them in place, so their defaults differ
(below); labels `sharding.dev/host-bandwidth` and `sharding.dev/file-bandwidth` on a node, or
`+host=GBPS` and `+files=GBPS` in `--devices`, set them.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, model_validator

from shard_contract.units import MiB, human, parse_bytes

from ..api import Placement, Toleration

SPEED_LABEL = "sharding.dev/gpu-speed"
MEMORY_LABEL = "nvidia.com/gpu.memory"  # MiB, from GPU feature discovery
OUR_MEMORY_LABEL = "sharding.dev/gpu-memory"  # ours: a quantity (80Gi, 81559Mi) or MiB as GFD writes it
PRODUCT_LABEL = "nvidia.com/gpu.product"
GKE_ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"  # GKE's own (nvidia-l4, nvidia-h100-80gb, ...)
COUNT_LABEL = "nvidia.com/gpu.count"
COMPUTE_LABELS = ("nvidia.com/gpu.compute.major", "nvidia.com/gpu.compute.minor")  # GFD too
# bfloat16 runs natively from compute capability 8.0 (Ampere) on: not on T4 (7.5) or V100 (7.0)
BF16_MAJOR = 8
# "cpu" marks a node whose devices are CPU memory budgets standing in for GPUs (the one-machine
# dev cluster): ranks run on the CPU, and the planner counts a CPU process's overhead.
KIND_LABEL = "sharding.dev/device-kind"
CPU_SPEED = 0.015  # TB/s: one core streaming decode-shaped matmuls (measured, ~15 GB/s)
HOST_BANDWIDTH_LABEL = "sharding.dev/host-bandwidth"
FILE_BANDWIDTH_LABEL = "sharding.dev/file-bandwidth"
# GB/s of pinned host-to-device copies: PCIe 4.0 x16 (32 GB/s raw, ~25 in practice). PCIe 5.0
# GPUs (H100, H200, B200) copy about twice as fast: label their nodes.
HOST_GBPS = 25.0
# GB/s of `preadv` from page-cached checkpoint files into a rank's buffer, one thread (measured on
# our 2-core build machines, under load: 2.5-3.2; quiet: 6-7): a GPU rank's file tier, and any copy.
# A cold file reads at its disk's rate instead.
FILE_GBPS = 3.0
# GB/s at which a CPU rank's prefetch thread maps a layer of page-cached checkpoint files into the
# process in place and the layer before out (bench/offload.py's fetch on our build machines: 16-33
# with the page cache as reads fill it, 4 KiB mapped at a time; 140-155 for freshly written files,
# whose 2 MiB folios map whole; docs/planner.md, "Offload"). The common case's low end.
MAPPED_FILE_GBPS = 15.0

# HBM bandwidth in TB/s from the vendors' datasheets (NVIDIA), matched as substrings of the GFD
# product label, most specific first.
KNOWN_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("GB200", 8.0), ("B200", 8.0), ("H200", 4.8), ("H100-NVL", 3.9), ("H100-PCIE", 2.0),
    ("H100", 3.35), ("H800", 3.35), ("A100-SXM4-80GB", 2.039), ("A100-PCIE-80GB", 1.935),
    ("A100", 1.555), ("A800", 2.039), ("L40S", 0.864), ("L40", 0.864), ("A40", 0.696),
    ("A10G", 0.6), ("A10", 0.6), ("L4", 0.3), ("T4", 0.32), ("V100", 0.9), ("RTX-4090", 1.008),
    ("RTX-6000-ADA", 0.96),
)


# Each GPU's memory in MiB by product, for nodes without GPU feature discovery (GKE, plain EKS):
# matched when every token of the entry is a token of the product label (split at "-", upper
# case), first entry first. A figure is what nvidia-smi reports as memory.total where a report was
# found (the source is named); otherwise the datasheet's capacity in decimal GB, which is below
# what the cards report (an H100 "80 GB" reports 81559 MiB, 85.5 GB), so a plan never counts on
# memory a card lacks. A MIG slice is never looked up: its memory is not the card's.
NVIDIA_SMI = "nvidia-smi memory.total, modal-labs/modal-client#2797"
KNOWN_MEMORY: tuple[tuple[tuple[str, ...], int, str], ...] = (
    (("H100", "NVL"), 95830, "nvidia-smi: 99961274368 bytes, fastfetch-cli/fastfetch#1658"),
    (("H100", "PCIE"), 76293, "datasheet: 80 GB"),
    (("H100",), 81559, NVIDIA_SMI),
    (("H200",), 134468, "datasheet: 141 GB"),
    (("B200",), 171661, "datasheet: 180 GB"),
    (("H800",), 76293, "datasheet: 80 GB"),
    (("A100", "80GB"), 81920, NVIDIA_SMI),
    (("A100",), 40960, f"{NVIDIA_SMI} (A100 40GB; GKE's nvidia-tesla-a100)"),
    (("L40S",), 46068, NVIDIA_SMI),
    (("L40",), 45776, "datasheet: 48 GB"),
    (("A40",), 45776, "datasheet: 48 GB"),
    (("A10G",), 22888, "datasheet: 24 GB"),
    (("A10",), 23028, NVIDIA_SMI),
    (("L4",), 23034, NVIDIA_SMI),
    (("T4",), 15360, NVIDIA_SMI),
    (("V100", "32GB"), 30517, "datasheet: 32 GB"),
    (("V100",), 15258, "datasheet: 16 GB"),
)


class Device(BaseModel):
    node: str
    index: int = Field(description="Index of the device on its node.")
    kind: Literal["gpu", "cpu"] = "gpu"
    product: str = ""
    memory_bytes: int = Field(gt=0)
    speed: float = Field(1.0, gt=0, description="Memory bandwidth in TB/s (relative speed).")
    host_gbps: float = Field(HOST_GBPS, gt=0, description="GB/s of copies from host memory into the device.")
    file_gbps: float = Field(FILE_GBPS, gt=0, description=(
        "GB/s of reads from the checkpoint files (default: FILE_GBPS on a GPU, MAPPED_FILE_GBPS on a CPU)."))
    zone: str = ""
    compute_capability: str = Field("", description="A GPU's, e.g. 8.0; empty when unknown.")

    @model_validator(mode="before")
    @classmethod
    def _file_rate_of_its_kind(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("file_gbps") is None and data.get("kind") == "cpu":
            return {**data, "file_gbps": MAPPED_FILE_GBPS}  # a CPU rank maps the files in place
        return data

    @property
    def native_bf16(self) -> bool:
        """Runs bfloat16 natively (or nobody said otherwise: a CPU, an unknown GPU)."""
        major = self.compute_capability.partition(".")[0]
        return not major.isdigit() or int(major) >= BF16_MAJOR

    @property
    def name(self) -> str:
        return f"{'cuda' if self.kind == 'gpu' else 'cpu'}:{self.index}"

    @property
    def key(self) -> tuple[str, int]:
        return (self.node, self.index)


class SkippedNode(BaseModel):
    node: str
    reason: str


class Inventory(BaseModel):
    devices: list[Device] = Field(default_factory=list)
    skipped: list[SkippedNode] = Field(default_factory=list)

    def nodes(self) -> list[str]:
        return sorted({d.node for d in self.devices})

    def describe(self) -> str:
        """One part per kind of device, e.g. '4 x 80.0 GiB (H100) on node-a; 2 x 256.0 MiB (cpu) on
        localhost': the product, or whether they are GPUs or CPU rank budgets."""
        groups: dict[tuple, list[Device]] = {}
        for d in self.devices:
            groups.setdefault((d.memory_bytes, d.product or d.kind, d.speed), []).append(d)
        parts = []
        for (memory, label, _), devs in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][1], -kv[0][2])):
            nodes = sorted({d.node for d in devs})
            where = nodes[0] if len(nodes) == 1 else f"{len(nodes)} nodes"
            parts.append(f"{len(devs)} x {human(memory)} ({label}) on {where}")
        return "; ".join(parts) or "no devices"


def memory_of(product: str) -> int | None:
    """MiB of one GPU of a known product (`KNOWN_MEMORY`), or None: unknown, or a MIG slice."""
    tokens = set(product.upper().replace(" ", "-").replace("_", "-").split("-"))
    if "MIG" in tokens:
        return None
    return next((mib for needles, mib, _ in KNOWN_MEMORY if tokens.issuperset(needles)), None)


def product_of(labels: dict[str, str]) -> str:
    """The GPU product: GPU feature discovery's label, else GKE's accelerator label."""
    return labels.get(PRODUCT_LABEL) or labels.get(GKE_ACCELERATOR_LABEL, "")


def gpu_memory(labels: dict[str, str]) -> tuple[int | None, str]:
    """Bytes of one GPU of a node, and where they come from (or why they are unknown): our label
    `sharding.dev/gpu-memory`, then GFD's `nvidia.com/gpu.memory` (MiB), then the product table."""
    if OUR_MEMORY_LABEL in labels:
        value = labels[OUR_MEMORY_LABEL]
        try:
            memory = int(value) * MiB if value.isdigit() else parse_bytes(value)
        except ValueError:
            memory = 0
        if memory <= 0:
            return None, f"{OUR_MEMORY_LABEL}={value}: expected a size such as 80Gi or 81559Mi (or MiB as a number)"
        return memory, OUR_MEMORY_LABEL
    if MEMORY_LABEL in labels:
        value = labels[MEMORY_LABEL]
        if not value.isdigit() or int(value) <= 0:
            return None, f"{MEMORY_LABEL}={value}: expected MiB as a positive number"
        return int(value) * MiB, MEMORY_LABEL
    product = product_of(labels)
    mib = memory_of(product) if product else None
    if mib is None:
        known = f"product {product} is not in the table of known GPUs" if product else "no product label either"
        return None, (f"no {MEMORY_LABEL} label (GPU feature discovery not running?), no {OUR_MEMORY_LABEL} label, and "
                      f"{known}: label the node {OUR_MEMORY_LABEL}=<memory of one GPU, e.g. 80Gi>")
    return mib * MiB, f"the known memory of {product}"


def bandwidth_of(product: str) -> float:
    normalized = product.upper().replace(" ", "-").replace("_", "-")
    for needle, tbps in KNOWN_BANDWIDTH:
        if needle in normalized:
            return tbps
    return 1.0


# ---------------------------------------------------------------- Kubernetes nodes
def _tolerates(tolerations: list[Toleration], taint: dict[str, Any]) -> bool:
    for t in tolerations:
        if t.effect is not None and t.effect != taint.get("effect"):
            continue
        if t.key is None and t.operator == "Exists":
            return True
        if t.key != taint.get("key"):
            continue
        if t.operator == "Exists" or (t.value or "") == (taint.get("value") or ""):
            return True
    return False


def _skip_reason(node: dict[str, Any], placement: Placement) -> str | None:
    meta, spec, status = node.get("metadata", {}), node.get("spec") or {}, node.get("status") or {}
    labels = meta.get("labels") or {}
    for key, value in placement.node_selector.items():
        if labels.get(key) != value:
            return f"not in the node pool ({key}={labels.get(key, '<unset>')}, want {value})"
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return "NotReady"
    if spec.get("unschedulable"):
        return "cordoned"
    for taint in spec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(placement.pod_tolerations, taint):
            return f"tainted {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')} (not tolerated)"
    allocatable = (status.get("allocatable") or {}).get(placement.gpu_resource)
    if allocatable in (None, "0", 0):
        return f"no allocatable {placement.gpu_resource}"
    memory, source = gpu_memory(labels)
    if memory is None:
        return source
    if labels.get(KIND_LABEL, "gpu") not in ("gpu", "cpu"):
        return f"{KIND_LABEL}={labels[KIND_LABEL]}: expected gpu or cpu"
    for label in (SPEED_LABEL, HOST_BANDWIDTH_LABEL, FILE_BANDWIDTH_LABEL):
        if label in labels and not _positive(labels[label]):
            return f"{label}={labels[label]}: expected a positive number"
    return None


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def devices_from_node(node: dict[str, Any], placement: Placement) -> list[Device]:
    """The GPUs one Node offers to this model (empty when skipped; see `_skip_reason`)."""
    if _skip_reason(node, placement) is not None:
        return []
    meta, status = node["metadata"], node.get("status") or {}
    labels = meta.get("labels") or {}
    count = int(str(status["allocatable"][placement.gpu_resource]))
    product = product_of(labels)
    speed = float(labels[SPEED_LABEL]) if SPEED_LABEL in labels else bandwidth_of(product)
    memory, _ = gpu_memory(labels)
    assert memory is not None  # _skip_reason said so
    zone = labels.get("topology.kubernetes.io/zone", "")
    kind = labels.get(KIND_LABEL, "gpu")
    rates = {field: float(labels[label]) for field, label in (("host_gbps", HOST_BANDWIDTH_LABEL),
                                                              ("file_gbps", FILE_BANDWIDTH_LABEL)) if label in labels}
    major, minor = (labels.get(label, "") for label in COMPUTE_LABELS)
    capability = f"{major}.{minor or 0}" if major else ""
    return [Device(node=meta["name"], index=i, kind=kind, product=product, memory_bytes=memory,
                   speed=speed, zone=zone, compute_capability=capability, **rates) for i in range(count)]


def inventory_from_nodes(nodes: Iterable[dict[str, Any]], placement: Placement | None = None) -> Inventory:
    placement = placement or Placement()
    inventory = Inventory()
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        reason = _skip_reason(node, placement)
        if reason is not None:
            inventory.skipped.append(SkippedNode(node=node["metadata"]["name"], reason=reason))
        else:
            inventory.devices.extend(devices_from_node(node, placement))
    return inventory


def load_nodes(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Nodes from `kubectl get nodes -o yaml` (a List) or a multi-document YAML of Nodes."""
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    nodes: list[dict[str, Any]] = []
    for doc in docs:
        if doc.get("kind") in ("List", "NodeList"):
            nodes.extend(item for item in doc.get("items") or [] if item.get("kind", "Node") == "Node")
        elif doc.get("kind") == "Node":
            nodes.append(doc)
    if not nodes:
        raise ValueError(f"{path}: no Node objects (write it with `kubectl get nodes -o yaml`)")
    return nodes


# ---------------------------------------------------------------- compact string
LOCAL_NODE = "localhost"  # this machine, in a device list and in `shardctl run`'s plans
DEVICES_FORMAT = ("NODE:MEMORY[*COUNT][@SPEED][:PRODUCT][+host=GBPS][+files=GBPS], e.g. node-a:80GiB*4 or "
                  "localhost:256MiB*2")
_DEVICE_SPEC = re.compile(r"^(?P<node>[A-Za-z0-9._-]+):(?P<mem>[0-9.]+[A-Za-z]*)"
                          r"(?:\*(?P<count>\d+))?(?:@(?P<speed>[0-9.]+))?(?::(?P<product>[A-Za-z0-9._-]+))?"
                          r"(?P<rates>(?:\+(?:host|files)=[0-9.]+)*)$")
_RATE_FIELDS = {"host": "host_gbps", "files": "file_gbps"}
DeviceKind = Literal["gpu", "cpu", "auto"]


def parse_devices(text: str, kind: DeviceKind = "gpu") -> Inventory:
    """Devices from "node-a:80GiB*4,node-b:24GiB*2@0.5":
    NODE:MEMORY[*COUNT][@SPEED][:PRODUCT][+host=GBPS][+files=GBPS].

    MEMORY needs its unit; SPEED is relative memory bandwidth (TB/s for GPUs); PRODUCT sets it
    from the known table. host and files are the GB/s of streamed layers (offload) from host
    memory and from the files. kind "auto": devices on `localhost` are what this machine runs
    ranks on (`local_kind`), devices on any other node GPUs.
    """
    if not text.strip():
        raise ValueError(f"the device list is empty; write {DEVICES_FORMAT}")
    devices: list[Device] = []
    next_index: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise ValueError(f"device list {text!r} has an empty entry; write {DEVICES_FORMAT}, comma-separated")
        match = _DEVICE_SPEC.match(item)
        if not match:
            raise ValueError(f"device spec {item!r}: write {DEVICES_FORMAT}")
        try:
            memory = parse_bytes(match["mem"])
        except ValueError as err:
            raise ValueError(f"device spec {item!r}: memory {err}") from None
        if memory <= 0:
            raise ValueError(f"device spec {item!r}: memory must be positive")
        count = int(match["count"] or 1)
        if count < 1:
            raise ValueError(f"device spec {item!r}: the count after * must be at least 1")
        node = match["node"]
        device_kind = (local_kind() if node == LOCAL_NODE else "gpu") if kind == "auto" else kind
        product = match["product"] or ""
        default_speed = CPU_SPEED if device_kind == "cpu" else (bandwidth_of(product) if product else 1.0)
        speed = float(match["speed"]) if match["speed"] else default_speed
        if speed <= 0:
            raise ValueError(f"device spec {item!r}: speed must be positive")
        rates = {}
        for part in filter(None, match["rates"].split("+")):
            name, _, value = part.partition("=")
            rates[_RATE_FIELDS[name]] = float(value)
            if rates[_RATE_FIELDS[name]] <= 0:
                raise ValueError(f"device spec {item!r}: {name} must be positive GB/s")
        for _ in range(count):
            index = next_index.get(node, 0)
            next_index[node] = index + 1
            devices.append(Device(node=node, index=index, kind=device_kind, product=product,
                                  memory_bytes=memory, speed=speed, **rates))
    return Inventory(devices=devices)


# ---------------------------------------------------------------- this machine
def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cuda_devices(node: str) -> list[Device]:
    """CUDA devices through nvidia-smi, so the control plane needs no torch."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,compute_cap,name",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
                             check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    devices = []
    for index, line in enumerate(s for s in out.splitlines() if s.strip()):
        memory, capability, name = (part.strip() for part in line.split(",", 2))
        devices.append(Device(node=node, index=index, kind="gpu", product=name, compute_capability=capability,
                              memory_bytes=int(float(memory)) * MiB, speed=bandwidth_of(name)))
    return devices


@functools.cache
def local_kind() -> Literal["gpu", "cpu"]:
    """What `shardctl run` runs ranks on here: the CUDA devices nvidia-smi lists, else the CPU."""
    return "gpu" if _cuda_devices(LOCAL_NODE) else "cpu"


def local_inventory(ranks: int | None = None, budget_bytes: int | None = None,
                    node: str = LOCAL_NODE) -> Inventory:
    """This machine: its CUDA devices when present, else `ranks` CPU devices sharing its memory.

    A CPU device is a rank's memory budget; by default the available memory split over one rank
    per core (at least two), keeping a quarter for everything else.
    """
    gpus = _cuda_devices(node)
    if gpus:
        return Inventory(devices=gpus)
    ranks = ranks or max(2, os.cpu_count() or 2)
    budget = budget_bytes or int(_available_memory() * 0.75 / ranks)
    return Inventory(devices=[Device(node=node, index=i, kind="cpu", product="cpu", memory_bytes=budget,
                                     speed=CPU_SPEED) for i in range(ranks)])
