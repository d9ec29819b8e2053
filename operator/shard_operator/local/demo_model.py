"""`shardctl demo-model DIR`: a random Llama checkpoint, so everything runs offline.

It is laid out as Hugging Face lays out a large checkpoint: `config.json`, `generation_config.json`,
the weights split over several safetensors files with `model.safetensors.index.json`, and a real
tokenizer: byte-level BPE trained with the `tokenizers` library on a small text shipped in this
package (`tokenizer.json`, and `tokenizer_config.json` with a chat template). The weights are
random, so the model writes fluent nonsense; everything else is what a real model has.

Torch-free (numpy and `safetensors.numpy`, from the `worker` extra), imported lazily so the
operator image, which has neither, can still import this module.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

from shard_contract.checkpoint import expected_tensors

CORPUS = files("shard_operator") / "data" / "demo-corpus.txt"
BOS, EOS, UNK = "<s>", "</s>", "<unk>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = [UNK, BOS, EOS, *(f"<|{role}|>" for role in ROLES), "<|end|>"]
# Each message as <|role|>, its text and <|end|>; the prompt ends where the assistant's answer begins.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
                 "{{ message['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@dataclass(frozen=True)
class DemoShape:
    layers: int = 8
    hidden: int = 768
    intermediate: int = 2048
    heads: int = 12
    kv_heads: int = 4
    vocab: int = 1024  # the tokenizer's most tokens (the small corpus gives about 750)
    max_positions: int = 2048
    files: int = 4
    seed: int = 0


def train_tokenizer(vocab_size: int, text: str | None = None) -> Any:
    """Byte-level BPE (any text round-trips) with Llama's habit of a BOS before every prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = text if text is not None else CORPUS.read_text(encoding="utf-8")
    tokenizer.train_from_iterator(corpus.splitlines(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    return tokenizer


def hf_config(shape: DemoShape, vocab_size: int, bos_id: int, eos_ids: list[int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads, "vocab_size": vocab_size,
        "max_position_embeddings": shape.max_positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_scaling": None, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "bos_token_id": bos_id, "eos_token_id": eos_ids,
    }


def split_files(sizes: dict[str, int], parts: int) -> list[list[str]]:
    """Tensors in checkpoint order cut into `parts` consecutive runs of about equal bytes (as
    `save_pretrained(max_shard_size=...)` does). Pure."""
    total, target = sum(sizes.values()), sum(sizes.values()) / max(1, parts)
    runs: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if runs[-1] and len(runs) < parts and filled + size / 2 > target * len(runs):
            runs.append([])
        runs[-1].append(name)
        filled += size
    assert filled == total
    return runs


def random_tensor(rng: Any, name: str, shape: list[int]) -> Any:
    """Values of a sensible scale: unit-ish norms, embeddings N(0, 1), projections that keep the
    residual stream's scale, and an LM head that spreads the logits (no near-ties for greedy)."""
    import numpy as np

    noise = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if "embed_tokens" in name:
        return noise
    scale = 3.0 if name.startswith("lm_head") else 1.0
    return noise * np.float32(scale / math.sqrt(shape[-1]))


def write_demo_model(directory: str | Path, shape: DemoShape = DemoShape(), *, overwrite: bool = False) -> Path:
    """Write the checkpoint into `directory` (created; all at once, so an interrupted write
    leaves nothing behind) and return it."""
    import numpy as np
    from safetensors.numpy import save_file

    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise FileExistsError(f"{directory} exists and is not empty (pass --force to replace it)")
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise ValueError(f"hidden {shape.hidden}, heads {shape.heads} and KV heads {shape.kv_heads}: the heads "
                         "must divide hidden, and the KV heads the heads")
    tokenizer = train_tokenizer(shape.vocab)
    bos, eos, end = (tokenizer.token_to_id(t) for t in (BOS, EOS, "<|end|>"))
    config = hf_config(shape, tokenizer.get_vocab_size(), bos, [eos, end])
    shapes = expected_tensors(config)
    runs = split_files({name: 4 * math.prod(s) for name, s in shapes.items()}, shape.files)

    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        rng = np.random.default_rng(shape.seed)
        weight_map = {}
        for i, names in enumerate(runs):
            file = f"model-{i + 1:05d}-of-{len(runs):05d}.safetensors"
            save_file({name: random_tensor(rng, name, shapes[name]) for name in names}, str(staging / file),
                      metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, file))
        total = sum(4 * math.prod(s) for s in shapes.values())
        _write_json(staging / "model.safetensors.index.json", {"metadata": {"total_size": total},
                                                                "weight_map": weight_map})
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", {"bos_token_id": bos, "eos_token_id": [eos, end]})
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
            "model_max_length": shape.max_positions, "chat_template": CHAT_TEMPLATE})
        _write_json(staging / "demo-model.json", {"written_by": "shardctl demo-model", **asdict(shape)})
        for path in [staging, *staging.iterdir()]:  # readable by a pod's non-root user, as a model store is
            path.chmod(0o755 if path.is_dir() else 0o644)
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def describe(directory: str | Path) -> str:
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    numel = sum(math.prod(s) for s in expected_tensors(config).values())
    files_ = sorted(directory.glob("*.safetensors"))
    return (f"wrote {directory}: a random Llama of {numel / 1e6:.1f}M parameters ({4 * numel / 2**20:.1f} MiB in "
            f"float32), {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
            f"{config['num_attention_heads']} heads / {config['num_key_value_heads']} KV heads, in {len(files_)} "
            f"safetensors files; a BPE tokenizer of {config['vocab_size']} tokens with a chat template")
