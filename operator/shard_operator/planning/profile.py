"""The model profile: how many elements every part of a checkpoint holds, and how they shard.

Read from `config.json` plus the safetensors headers only (8 bytes of length + a JSON header per
file; never the tensor data), or computed from `config.json` alone so a 70B model can be planned
before it is downloaded. Counts are kept in elements, not bytes, because the runtime dtype may
differ from the checkpoint's.

How each tensor of a decoder layer splits under tensor parallelism (Megatron-style):
  column  q/gate/up projections (and q bias): rows divided by TP
  kv      k/v projections (and their bias): divided by min(TP, kv heads) -- replicated beyond
  row     o/down projections: columns divided by TP
  replicated  layer norms (every rank holds a copy)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Literal

from pydantic import BaseModel, Field

from shard_contract.checkpoint import (
    DTYPE_BYTES,
    SAFETENSORS_DTYPE,
    TORCH_DTYPE_BYTES,
    CheckpointError,
    CheckpointFacts,
    ModelShape,
    TensorInfo,
    check_config,
    expected_tensors,
    read_checkpoint,
    shape_numel,
)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_COLUMN = ("self_attn.q_proj.", "mlp.gate_proj.", "mlp.up_proj.")
_KV = ("self_attn.k_proj.", "self_attn.v_proj.")
_ROW_WEIGHTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_IGNORED = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry; recomputed at load


class LayerProfile(BaseModel):
    """Elements of one decoder layer by how they split under tensor parallelism; and of those,
    the projection matrices' elements and output rows (what int8 quantizes, with one scale a row).
    Those have no default, so a profile cached by an older operator, which lacks them, fails
    validation and is profiled again."""

    column: int = 0
    kv: int = 0
    row: int = 0
    replicated: int = 0
    column_matrix: int
    kv_matrix: int
    column_rows: int
    kv_rows: int
    row_rows: int
    # Of the projection matrices' elements, those whose data do not start at a multiple of their
    # element size (only a non-standard writer puts them so): a CPU rank that streams them copies
    # them instead of computing on the file in place (offload).
    unaligned_column: int = 0
    unaligned_kv: int = 0
    unaligned_row: int = 0

    @property
    def numel(self) -> int:
        return self.column + self.kv + self.row + self.replicated


class ModelProfile(BaseModel):
    """A model as the planner sizes it: its shape (the contract's one parse of config.json) and the
    elements of its tensors by how they split."""

    name: str
    source: Literal["safetensors", "config"]
    dtype: str = Field(description="Checkpoint dtype (torch name).")
    shape: ModelShape
    embed_numel: int
    lm_head_numel: int = Field(description="0 when tied to the embeddings.")
    final_norm_numel: int
    other_numel: int = Field(0, description="Tensors outside the known layout; held by every rank.")
    layers: list[LayerProfile]
    checkpoint_bytes: int = Field(description="Bytes of all tensors as stored.")
    files: list[str] = Field(default_factory=list)
    tensors: dict[str, TensorInfo] = Field(default_factory=dict, exclude=True)
    digest: str = Field("", description="sha256 of config.json and every safetensors header.")

    @property
    def total_numel(self) -> int:
        return (self.embed_numel + self.lm_head_numel + self.final_norm_numel + self.other_numel
                + sum(layer.numel for layer in self.layers))

    def dtype_bytes(self, dtype: str = "auto") -> int:
        return TORCH_DTYPE_BYTES[self.dtype if dtype == "auto" else dtype]

    def kv_bytes_per_token(self, dtype: str = "auto") -> int:
        """KV-cache bytes one token costs across all layers (keys + values, unsharded)."""
        shape = self.shape
        return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * self.dtype_bytes(dtype)


# ---------------------------------------------------------------- the profile
def _classify(name: str) -> tuple[str, int | None]:
    """Which part of the model a tensor belongs to, and its layer index."""
    if name.startswith("model.embed_tokens."):
        return "embed", None
    if name.startswith("model.norm."):
        return "final_norm", None
    if name.startswith("lm_head."):
        return "lm_head", None
    match = _LAYER.match(name)
    if match:
        layer, rest = int(match.group(1)), match.group(2)
        if rest.endswith(_IGNORED):
            return "ignored", layer
        if rest.startswith(_COLUMN):
            return "column", layer
        if rest.startswith(_KV):
            return "kv", layer
        if rest in _ROW_WEIGHTS:
            return "row", layer
        return "replicated", layer  # norms, and the row-parallel biases, which every rank adds once
    return "other", None


def _build(config: dict[str, Any], infos: dict[str, TensorInfo], source: str, name: str,
           digest: str) -> ModelProfile:
    shape = ModelShape.from_config(config)
    layers = [LayerProfile(column_matrix=0, kv_matrix=0, column_rows=0, kv_rows=0, row_rows=0)
              for _ in range(shape.num_layers)]
    parts = {"embed": 0, "lm_head": 0, "final_norm": 0, "other": 0}
    for tensor_name, info in infos.items():
        part, layer = _classify(tensor_name)
        if part == "ignored" or (part == "lm_head" and shape.tie_word_embeddings):
            continue
        if layer is not None:
            if layer >= len(layers):
                raise CheckpointError(f"tensor {tensor_name} (in {info.file}) names layer {layer}, but "
                                      f"config.json has num_hidden_layers={len(layers)}")
            lp = layers[layer]
            setattr(lp, part, getattr(lp, part) + info.numel)
            if part in ("column", "kv", "row") and tensor_name.endswith(".weight") and len(info.shape) == 2:
                if part != "row":
                    setattr(lp, f"{part}_matrix", getattr(lp, f"{part}_matrix") + info.numel)
                setattr(lp, f"{part}_rows", getattr(lp, f"{part}_rows") + info.shape[0])
                if not info.aligned:
                    setattr(lp, f"unaligned_{part}", getattr(lp, f"unaligned_{part}") + info.numel)
        else:
            parts[part] += info.numel
    dtypes = {info.dtype for info in infos.values()}
    checkpoint_dtype = SAFETENSORS_DTYPE.get(dtypes.pop(), "float32") if len(dtypes) == 1 else \
        config.get("torch_dtype") or config.get("dtype") or "float32"
    if source == "config":
        checkpoint_dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    if checkpoint_dtype not in TORCH_DTYPE_BYTES:
        checkpoint_dtype = "float32"
    return ModelProfile(
        name=name, source=source, dtype=checkpoint_dtype, shape=shape,
        embed_numel=parts["embed"], lm_head_numel=parts["lm_head"],
        final_norm_numel=parts["final_norm"], other_numel=parts["other"], layers=layers,
        checkpoint_bytes=sum(info.nbytes for info in infos.values()),
        files=sorted({info.file for info in infos.values()}), tensors=infos, digest=digest,
    )


def profile_from_config(config: dict[str, Any], name: str = "model") -> ModelProfile:
    """The profile an HF checkpoint of this config would have (no weights needed)."""
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    st_dtype = {v: k for k, v in SAFETENSORS_DTYPE.items()}.get(dtype, "F32")
    infos = {n: TensorInfo(file="", dtype=st_dtype, shape=s, numel=shape_numel(s),
                           nbytes=shape_numel(s) * DTYPE_BYTES[st_dtype], offset=0)
             for n, s in expected_tensors(config).items()}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return _build(config, infos, "config", name, digest)


def profile_from_facts(facts: CheckpointFacts) -> ModelProfile:
    """The profile of a checkpoint as `read_checkpoint` (here, or in a profiling Pod) found it."""
    check_config(facts.config, f"config.json of {facts.name}")  # a profiling Pod's output is input too
    if facts.tensors is None:
        return profile_from_config(facts.config, name=facts.name)
    return _build(facts.config, facts.tensors, "safetensors", facts.name, facts.digest)


def profile_model(model_dir: str | os.PathLike[str]) -> ModelProfile:
    """Profile a model directory from config.json and, when present, its safetensors headers."""
    return profile_from_facts(read_checkpoint(model_dir))
