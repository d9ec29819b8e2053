"""Each rank holds exactly its slices: put every rank's tensors back together and get each full
checkpoint tensor (KV heads copied when TP exceeds them, vocabulary padding zero)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from .conftest import make_plan
from .pool import TensorsJob

pytestmark = pytest.mark.slow


def full_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    index = model_dir / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    out = {}
    for file in files:
        with safe_open(model_dir / file, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def reassemble(results: list[dict]) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors rebuilt from every rank's pieces, with the arithmetic written out
    independently of the worker: rank r holds heads [r*H/tp, (r+1)*H/tp) and the KV head those
    query heads attend to."""
    out: dict[str, torch.Tensor] = {}
    by_stage: dict[int, list[dict]] = {}
    for r in results:
        by_stage.setdefault(r["layout"].layers[0], []).append(r)
    for ranks in by_stage.values():
        ranks.sort(key=lambda r: r["layout"].tp_rank)
        lay = ranks[0]["layout"]
        c, tp = lay.config, lay.tp
        hd, H, KV = c.head_dim, c.num_heads, c.num_kv_heads
        q_local, kv_local = H // tp * hd, max(1, KV // tp) * hd
        inter = c.intermediate_size // tp
        t = [r["tensors"] for r in ranks]
        for i in range(*lay.layers):
            p, src = f"layers.{i}.", f"model.layers.{i}."
            kinds = ("weight", "bias") if f"{p}qkv.bias" in t[0] else ("weight",)
            for kind in kinds:
                qkv = [x[p + f"qkv.{kind}"] for x in t]
                out[src + f"self_attn.q_proj.{kind}"] = torch.cat([x[:q_local] for x in qkv])
                heads = {}  # KV head -> (k, v); ranks sharing a head must hold identical copies
                for r, x in enumerate(qkv):
                    head = (r * H // tp) // (H // KV)
                    k, v = x[q_local:q_local + kv_local], x[q_local + kv_local:]
                    if head in heads:
                        assert torch.equal(heads[head][0], k) and torch.equal(heads[head][1], v)
                    heads.setdefault(head, (k, v))
                out[src + f"self_attn.k_proj.{kind}"] = torch.cat([heads[h][0] for h in sorted(heads)])
                out[src + f"self_attn.v_proj.{kind}"] = torch.cat([heads[h][1] for h in sorted(heads)])
            for kind in ("weight", "bias") if f"{p}gate_up.bias" in t[0] else ("weight",):
                out[src + f"mlp.gate_proj.{kind}"] = torch.cat([x[p + f"gate_up.{kind}"][:inter] for x in t])
                out[src + f"mlp.up_proj.{kind}"] = torch.cat([x[p + f"gate_up.{kind}"][inter:] for x in t])
            out[src + "self_attn.o_proj.weight"] = torch.cat([x[p + "o.weight"] for x in t], dim=1)
            out[src + "mlp.down_proj.weight"] = torch.cat([x[p + "down.weight"] for x in t], dim=1)
            for ours, theirs in (("input_norm", "input_layernorm"), ("post_norm", "post_attention_layernorm")):
                assert all(torch.equal(x[p + f"{ours}.weight"], t[0][p + f"{ours}.weight"]) for x in t)
                out[src + f"{theirs}.weight"] = t[0][p + f"{ours}.weight"]
        for ours, theirs in (("embed.weight", "model.embed_tokens.weight"), ("lm_head.weight", "lm_head.weight")):
            if ours in t[0]:
                rows = torch.cat([x[ours] for x in t])
                assert not rows[c.vocab_size:].any(), "vocabulary padding must be zero"
                name = "model.embed_tokens.weight" if c.tie_word_embeddings else theirs
                if name in out:
                    assert torch.equal(out[name], rows[:c.vocab_size]), "tied copies differ"
                out[name] = rows[:c.vocab_size]
        if "norm.weight" in t[0]:
            out["model.norm.weight"] = t[0]["norm.weight"]
    return out


@pytest.mark.parametrize("name,tp,pp", [("qwen2", 4, 1), ("llama3-tied", 2, 2), ("llama-4layers", 2, 2)])
def test_rank_slices_reassemble_every_tensor(pool, checkpoint, name, tp, pp):
    model_dir = checkpoint(name)
    results = pool.run(make_plan(model_dir, tp, pp), model_dir, TensorsJob())
    rebuilt, full = reassemble(results), full_tensors(model_dir)
    assert rebuilt.keys() == full.keys()
    for key, tensor in full.items():
        assert torch.equal(rebuilt[key], tensor), key


def test_bfloat16_runtime_converts_while_loading(pool, checkpoint):
    """A float32 checkpoint run in bfloat16 goes through the staging path: each slice is the
    checkpoint's, rounded to bfloat16."""
    model_dir = checkpoint("llama")
    results = pool.run(make_plan(model_dir, 2, 1, dtype="bfloat16"), model_dir, TensorsJob())
    for r in results:
        assert all(t.dtype == torch.bfloat16 for t in r["tensors"].values())
    rebuilt, full = reassemble(results), full_tensors(model_dir)
    for key, tensor in full.items():
        assert torch.equal(rebuilt[key], tensor.to(torch.bfloat16)), key
