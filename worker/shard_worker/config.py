"""The model's shape and numerics, read from HF `config.json` (Llama, Mistral, Qwen2). Torch-free.

The shape (sizes, heads, which biases exist) is the contract's `ModelShape`, the one parse of
config.json the planner sizes with too, so the two sides cannot disagree about a Qwen2 bias; this
module adds what only the runtime needs (norm epsilon, RoPE, sliding windows, EOS ids).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shard_contract.checkpoint import ModelShape, model_file, read_config, read_json

ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A config.json this worker cannot run; the message names the file and the field."""


@dataclass(frozen=True)
class ModelConfig(ModelShape):
    rms_norm_eps: float
    rope: dict[str, Any]  # rope_type, rope_theta and the scaling fields of that type
    sliding_windows: tuple[int | None, ...]  # per layer: attend to at most this many positions
    eos_token_ids: tuple[int, ...]
    tensor_shapes: dict[str, list[int]]  # every checkpoint tensor name -> shape

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        config = read_config(model_dir)
        generation = model_file(model_dir, "generation_config.json")
        extra = read_json(generation, "generation_config.json") if generation.exists() else {}
        extra_eos = extra.get("eos_token_id") if isinstance(extra, dict) else None
        return cls.from_hf(config, source=str(model_dir / "config.json"), extra_eos=extra_eos)

    @classmethod
    def from_hf(cls, config: dict[str, Any], source: str = "config.json", extra_eos: Any = None) -> ModelConfig:
        """From a config that `read_config` accepted."""
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (SwiGLU needs silu)")
        shape = ModelShape.from_config(config)
        return cls(
            **asdict(shape),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=rope_parameters(config, source),
            sliding_windows=sliding_windows(config, shape.architecture),
            eos_token_ids=tuple(dict.fromkeys(_ids(config.get("eos_token_id")) + _ids(extra_eos))),
            tensor_shapes=shape.expected_tensors(),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def rope_parameters(config: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """RoPE settings from either spelling: transformers 5's `rope_parameters`, or the
    `rope_theta` + `rope_scaling` of released checkpoints."""
    rope = dict(config.get("rope_parameters") or {})
    if not rope:
        rope = dict(config.get("rope_scaling") or {})
        rope["rope_theta"] = config.get("rope_theta", 10000.0)
    rope_type = rope.pop("type", None) or rope.get("rope_type") or "default"
    rope["rope_type"] = rope_type
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    needs = {"linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [key for key in needs.get(rope_type, ()) if key not in rope]
    if missing:
        raise ConfigError(f"{source}: rope type {rope_type!r} needs {', '.join(missing)}")
    return rope


def sliding_windows(config: dict[str, Any], arch: str) -> tuple[int | None, ...]:
    """Per layer, the attention window (None: full attention), as HF decides it per family."""
    n, window = config["num_hidden_layers"], config.get("sliding_window")
    layer_types = config.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch == "MistralForCausalLM":
        return (window,) * n
    if arch == "Qwen2ForCausalLM" and config.get("use_sliding_window"):
        first = config.get("max_window_layers", n)
        return tuple(window if i >= first else None for i in range(n))
    return (None,) * n


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
