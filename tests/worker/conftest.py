"""Fixtures of the worker tests: tiny random checkpoints written by HF transformers, the HF model
as the reference, plans from the real planner, and the pool of rank processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.checkpoints import LLAMA3_ROPE, load_hf, write_checkpoint

from .pool import RankPool

SMALL = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, vocab_size=250,
             max_position_embeddings=256)

# name -> write_checkpoint arguments. vocab 250 leaves padding rows on the last of 4 TP ranks;
# 2 KV heads are fewer than TP=4.
MODELS = {
    "llama": dict(family="llama", num_layers=2, **SMALL),
    "mistral": dict(family="mistral", num_layers=2, sliding_window=6, **SMALL),  # the window bites
    "qwen2": dict(family="qwen2", num_layers=2, max_shard_size="40KB", **SMALL),  # q/k/v bias, many files
    "llama3-tied": dict(family="llama", num_layers=2, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE,
                        legacy_rope_config=True, **SMALL),
    "llama-4layers": dict(family="llama", num_layers=4, tokenizer=True, **SMALL),
    "llama-mqa": dict(family="llama", num_layers=2, **{**SMALL, "num_kv_heads": 1}),  # one KV head for all
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> directory of the MODELS[name] checkpoint, written once per session."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            args = dict(MODELS[name])
            made[name] = write_checkpoint(tmp_path_factory.mktemp(name), args.pop("family"), seed=len(made), **args)
        return made[name]
    return get


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(directory) -> the checkpoint as an HF model (float32, eval), loaded once."""
    loaded = {}

    def get(directory: Path):
        if directory not in loaded:
            loaded[directory] = load_hf(directory)
        return loaded[directory]
    return get


@pytest.fixture(scope="session")
def pool():
    p = RankPool()
    yield p
    p.close()


def make_plan(model_dir: Path, tp: int, pp: int, *, max_len: int = 64, batch: int = 1,
              partition: list[int] | None = None, dtype: str = "auto", quantization: str = "none"):
    from shard_operator.local.launcher import plan_local

    return plan_local(model_dir, tp, pp, dtype=dtype, quantization=quantization, max_model_len=max_len,
                      max_batch_size=batch,
                      devices="local:4GiB*8", device_kind="cpu", layer_partition=partition)


# 24 layers: 25% streamed is 6 layers on one stage, 3 on each of two.
SHAPE = dict(hidden_size=64, intermediate_size=128, num_layers=24, num_heads=4, num_kv_heads=2, vocab_size=250,
             max_position_embeddings=256)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("deep"), "llama", seed=7, **SHAPE)


@pytest.fixture(scope="module")
def by_dtype(tmp_path_factory):
    """One random model (40M parameters) stored as float32, bfloat16 and float16."""
    shape = dict(hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8, num_kv_heads=4,
                 vocab_size=8000, max_position_embeddings=512)
    return {dtype: write_checkpoint(tmp_path_factory.mktemp(dtype), "llama", dtype=dtype, **shape)
            for dtype in ("float32", "bfloat16", "float16")}
