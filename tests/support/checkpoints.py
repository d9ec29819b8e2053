"""Tiny random Llama / Mistral / Qwen2 checkpoints, written by HF transformers itself.

`write_checkpoint(directory, family, ...)` builds the HF model from a config, gives every tensor
well-spread random values (HF's own init leaves biases at zero and norms at one, which would hide
bugs in exactly those places), and saves it with `save_pretrained`: one `model.safetensors`, or
several files plus `model.safetensors.index.json` when `max_shard_size` is given. With
`tokenizer=True` it also writes a word-level `tokenizer.json` whose words are `w<id>`.

Imports transformers lazily: importing this module costs nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}

# Llama 3.1's published rope scaling, with a small original context so tiny tests exercise all
# three frequency bands (long wavelengths scaled, short ones kept, the middle ones smoothed).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def hf_config(family: str = "llama", *, hidden_size: int = 64, intermediate_size: int = 128,
              num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, vocab_size: int = 256,
              max_position_embeddings: int = 256, tie_word_embeddings: bool = False,
              rope_theta: float = 10000.0, rope_scaling: dict[str, Any] | None = None,
              **overrides: Any):
    """The HF config object of a tiny model of `family`."""
    import transformers

    config_cls = getattr(transformers, FAMILIES[family][0])
    rope = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    rope["rope_theta"] = rope_theta
    return config_cls(hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads,
                      num_key_value_heads=num_kv_heads, vocab_size=vocab_size,
                      max_position_embeddings=max_position_embeddings,
                      tie_word_embeddings=tie_word_embeddings, rope_parameters=rope,
                      bos_token_id=1, eos_token_id=2, **overrides)


def randomize(model, seed: int = 0) -> None:
    """Give every tensor of an HF causal LM random values of a sensible scale (in place)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.2 * noise
            elif name.endswith(".bias"):
                value = 0.2 * noise
            elif "embed_tokens" in name:
                value = noise
            elif name.startswith("lm_head"):
                value = noise * 3.0 / math.sqrt(param.shape[1])  # spread logits: no near-ties
            else:
                value = noise / math.sqrt(param.shape[1])
            param.copy_(value.to(param.dtype))


def write_checkpoint(directory: str | Path, family: str = "llama", *, seed: int = 0,
                     dtype: str = "float32", max_shard_size: str | int | None = None,
                     tokenizer: bool = False, legacy_rope_config: bool = False,
                     **config_args: Any) -> Path:
    """Write a random `family` checkpoint into `directory` and return it.

    `config_args` go to `hf_config` (sizes, `tie_word_embeddings`, `rope_scaling`, and any HF
    config field such as `sliding_window`). `legacy_rope_config` rewrites config.json the way
    released checkpoints spell RoPE (`rope_theta` + `rope_scaling`) instead of transformers 5's
    `rope_parameters`.
    """
    import torch
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config(family, **config_args)
    model = getattr(transformers, FAMILIES[family][1])(config)
    randomize(model, seed)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(directory, **kwargs)
    if legacy_rope_config:
        _legacy_rope(directory / "config.json")
    if tokenizer:
        write_tokenizer(directory, config.vocab_size)
    return directory


def _legacy_rope(path: Path) -> None:
    config = json.loads(path.read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    path.write_text(json.dumps(config, indent=2))


def write_tokenizer(directory: str | Path, vocab_size: int) -> Path:
    """A word-level tokenizer.json: token id i is the word `w<i>` (0-2 are <unk>, <s>, </s>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    path = Path(directory) / "tokenizer.json"
    tok.save(str(path))
    return path


def break_embedding(source: str | Path, directory: str | Path, token: int) -> Path:
    """A copy of the checkpoint in `source` whose embedding of `token` is all NaN: a sequence whose
    prompt holds it gets NaN logits, the others are untouched (rows never mix)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    directory = Path(shutil.copytree(source, directory))
    for path in directory.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            if "model.embed_tokens.weight" not in f.keys():
                continue
        tensors = load_file(path)
        tensors["model.embed_tokens.weight"][token] = float("nan")
        save_file(tensors, path, metadata={"format": "pt"})
    return directory


def load_hf(directory: str | Path, dtype: str = "float32"):
    """The checkpoint as an HF model in eval mode (the reference the worker is compared with)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=getattr(torch, dtype)).eval()


def misalign(path: str | Path) -> None:
    """Rewrite one safetensors file with its header padded to an odd length, so that the data of
    every tensor in it start one byte past an element boundary: what an old or non-standard
    writer may do (safetensors' own pads the header to 8 bytes), and the format allows."""
    import struct

    path = Path(path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + length].rstrip(b" ")
    header += b" " * ((1 - 8 - len(header)) % 8)  # 8 + header: 1 mod 8
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length:])
