"""The model's shape and numerics, read from HF `config.json` (Llama, Mistral, Qwen2). Torch-free.

The shape (sizes, heads, which biases exist) is the contract's `ModelShape`, the one parse of
config.json the planner sizes with too, so the two sides cannot disagree about a Qwen2 bias; this
module adds what only the runtime needs (norm epsilon, RoPE, sliding windows, EOS ids).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shard_contract.checkpoint import (
    LIMITS,
    CheckpointError,
    ModelShape,
    model_file,
    read_config,
    read_json,
    show_value,
)

ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")
MAX_POSITIONS = LIMITS["max_position_embeddings"]
MAX_EOS_IDS = 1024


class ConfigError(CheckpointError):
    """A config.json this worker cannot run; the message names the file and the field. A
    CheckpointError: a restart cannot fix it (the worker exits with the no-retry status)."""


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
        config_source = str(model_file(model_dir, "config.json"))
        vocab = config["vocab_size"]
        extra_ids = _ids(extra_eos, vocab, f"{generation}: eos_token_id")  # named as its own file
        return cls.from_hf(config, source=config_source, extra_eos=list(extra_ids) or None)

    @classmethod
    def from_hf(cls, config: dict[str, Any], source: str = "config.json", extra_eos: Any = None) -> ModelConfig:
        """From a config that `read_config` accepted. Every field read here is checked for its type
        and range where it is read: a bad one is a `ConfigError` naming `source` and the field."""
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {show_value(act)} is not supported (SwiGLU needs silu)")
        shape = ModelShape.from_config(config)
        vocab = shape.vocab_size
        return cls(
            **asdict(shape),
            rms_norm_eps=number(config, "rms_norm_eps", 1e-6, source, 0.0, 1.0),
            rope=rope_parameters(config, source),
            sliding_windows=sliding_windows(config, shape.architecture, source),
            eos_token_ids=tuple(dict.fromkeys(_ids(config.get("eos_token_id"), vocab, f"{source}: eos_token_id")
                                              + _ids(extra_eos, vocab, f"{source}: eos_token_id"))),
            tensor_shapes=shape.expected_tensors(),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def number(fields: dict[str, Any], key: str, default: float | None, where: str, low: float, high: float,
           name: str | None = None) -> float:
    """Field `key` of `fields` as a float in (low, high] (`default` when absent or null)."""
    value = fields.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not low < value <= high:
        raise ConfigError(f"{where}: {name or key} must be a number above {low:g} and at most {high:g} "
                          f"(got {show_value(value)})")
    return float(value)


def integer(fields: dict[str, Any], key: str, where: str, low: int, high: int, name: str | None = None) -> int:
    value = fields.get(key)
    if type(value) is not int or not low <= value <= high:
        raise ConfigError(f"{where}: {name or key} must be an integer from {low} to {high} (got {show_value(value)})")
    return value


def rope_parameters(config: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """RoPE settings from either spelling: transformers 5's `rope_parameters`, or the
    `rope_theta` + `rope_scaling` of released checkpoints; every number in a range where the
    frequencies are finite and no division is by zero."""
    field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    given = config.get(field)
    if given is not None and not isinstance(given, dict):
        raise ConfigError(f"{source}: {field} must be a JSON object or null (got {show_value(given)})")
    rope = dict(given or {})
    if field == "rope_scaling":
        rope["rope_theta"] = config.get("rope_theta")
    rope_type = rope.pop("type", None) or rope.get("rope_type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope type {show_value(rope_type)} is not supported; supported: "
                          f"{', '.join(ROPE_TYPES)}")
    rope["rope_type"] = rope_type
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = config.get("rope_theta")
    where = f"{source}: {field}" if field == "rope_parameters" else source
    rope["rope_theta"] = number(rope, "rope_theta", 10000.0, where, 1.0, 1e12)
    needs = {"linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [key for key in needs.get(rope_type, ()) if key not in rope]
    if missing:
        raise ConfigError(f"{source}: rope type {rope_type!r} needs {', '.join(missing)}")
    where = f"{source}: {field}"
    if rope_type in ("linear", "llama3"):
        rope["factor"] = number(rope, "factor", None, where, 0.0, 1e6)
    if rope_type == "llama3":
        low = rope["low_freq_factor"] = number(rope, "low_freq_factor", None, where, 0.0, 1e6)
        high = rope["high_freq_factor"] = number(rope, "high_freq_factor", None, where, 0.0, 1e6)
        if not high > low:  # the band between them is blended by 1 / (high - low)
            raise ConfigError(f"{where}: high_freq_factor ({high:g}) must be above low_freq_factor ({low:g})")
        rope["original_max_position_embeddings"] = integer(rope, "original_max_position_embeddings", where, 1,
                                                           MAX_POSITIONS)
    return rope


def sliding_windows(config: dict[str, Any], arch: str, source: str = "config.json") -> tuple[int | None, ...]:
    """Per layer, the attention window (None: full attention), as HF decides it per family."""
    n = config["num_hidden_layers"]
    window = None if config.get("sliding_window") is None else \
        integer(config, "sliding_window", source, 1, MAX_POSITIONS)
    layer_types = config.get("layer_types")
    if layer_types:
        if not isinstance(layer_types, list) or len(layer_types) != n or \
                not all(isinstance(t, str) and t in LAYER_TYPES for t in layer_types):
            raise ConfigError(f"{source}: layer_types must list one of {', '.join(LAYER_TYPES)} for each of the "
                              f"{n} layers (got {show_value(layer_types)})")
        if window is None and "sliding_attention" in layer_types:
            raise ConfigError(f"{source}: layer_types has sliding_attention layers but sliding_window is not set")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch == "MistralForCausalLM":
        return (window,) * n
    use = config.get("use_sliding_window")
    if use is not None and not isinstance(use, bool):
        raise ConfigError(f"{source}: use_sliding_window must be true or false (got {show_value(use)})")
    if arch == "Qwen2ForCausalLM" and use and window is not None:
        first = n if config.get("max_window_layers") is None else integer(config, "max_window_layers", source, 0, n)
        return tuple(window if i >= first else None for i in range(n))
    return (None,) * n


def _ids(value: Any, vocab: int, where: str) -> tuple[int, ...]:
    """An EOS id or a list of them, each a token id of the vocabulary."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if len(ids) > MAX_EOS_IDS or not all(type(i) is int and 0 <= i < vocab for i in ids):
        raise ConfigError(f"{where} must be a token id from 0 to {vocab - 1} or a list of at most {MAX_EOS_IDS} "
                          f"of them (got {show_value(value)})")
    return tuple(ids)
