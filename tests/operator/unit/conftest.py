"""Fixtures for the pure tests: tiny checkpoints written by HF transformers itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 96, "max_position_embeddings": 1024}


def hf_config(architecture: str = "LlamaForCausalLM", **overrides):
    import transformers
    cls = {"LlamaForCausalLM": transformers.LlamaConfig, "MistralForCausalLM": transformers.MistralConfig,
           "Qwen2ForCausalLM": transformers.Qwen2Config}[architecture]
    return cls(**{**TINY, **overrides})


def write_hf_checkpoint(directory: Path, architecture: str = "LlamaForCausalLM",
                        max_shard_size: str | None = None, **overrides) -> dict[str, int]:
    """Save a random model with `save_pretrained`; return {tensor name: bytes} of what it holds."""
    import torch
    import transformers
    torch.manual_seed(0)
    config = hf_config(architecture, **overrides)
    model = getattr(transformers, architecture)(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    seen, sizes = set(), {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:  # tied weights are stored once
            continue
        seen.add(tensor.data_ptr())
        sizes[name] = tensor.numel() * tensor.element_size()
    return sizes


@pytest.fixture
def hf_checkpoint(tmp_path: Path):
    def make(architecture: str = "LlamaForCausalLM", max_shard_size: str | None = None, **overrides):
        directory = tmp_path / f"{architecture}-{max_shard_size or 'single'}-{len(list(tmp_path.iterdir()))}"
        sizes = write_hf_checkpoint(directory, architecture, max_shard_size, **overrides)
        return directory, sizes
    return make


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
