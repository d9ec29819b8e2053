"""Sharded generation matches HF transformers on the unsharded model: logits at every generated
position (float32, tight tolerance) and greedy tokens, for every family, TP x PP layout, and the
awkward cases (KV heads < TP, tied embeddings, llama3 RoPE, uneven stages, many files)."""

from __future__ import annotations

import pytest
import torch

from .conftest import make_plan
from .pool import GenerateJob

PROMPT = [3, 17, 42, 99, 7, 200, 64, 11]
NEW_TOKENS = 5
pytestmark = pytest.mark.slow


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """HF's logits at the positions that chose each generated token: [len(generated), vocab] (on
    the CPU, wherever the model runs)."""
    ids = torch.tensor([prompt + generated[:-1]], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float().cpu()
    return logits[len(prompt) - 1:]


def run_greedy(pool, plan, model_dir, prompts: list[list[int]], new_tokens: int = NEW_TOKENS,
               env: dict | None = None) -> list[dict]:
    job = GenerateJob([{"prompt_ids": p, "max_new_tokens": new_tokens, "ignore_eos": True} for p in prompts],
                      env=env)
    return pool.run(plan, model_dir, job)


def assert_matches_hf(results: list[dict], model, prompts: list[list[int]], tolerance: float = 1e-4) -> None:
    out = results[0]["output"]
    for row, prompt in enumerate(prompts):
        tokens = out.completions[row].token_ids
        assert tokens == hf_greedy(model, prompt, len(tokens))
        ours = torch.stack([step[row] for step in out.logits])
        torch.testing.assert_close(ours, hf_logits(model, prompt, tokens), rtol=tolerance, atol=tolerance)
    # Every first-stage TP rank tracked the same tokens (they feed the embedding).
    for r in results[1:]:
        if r["output"] is not None:
            assert [c.token_ids for c in r["output"].completions] == [c.token_ids for c in out.completions]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)])
def test_family_layouts_match_hf(pool, checkpoint, hf_model, family, tp, pp):
    model_dir = checkpoint(family)
    results = run_greedy(pool, make_plan(model_dir, tp, pp), model_dir, [PROMPT])
    assert_matches_hf(results, hf_model(model_dir), [PROMPT])


@pytest.mark.parametrize("shared_memory", [True, False])
def test_tp_collectives_with_and_without_shared_memory(pool, checkpoint, hf_model, shared_memory):
    """TP peers on one machine sum through shared memory; elsewhere (pods) through gloo."""
    model_dir = checkpoint("llama")
    env = None if shared_memory else {"SHARD_SHM_COLLECTIVES": "0"}
    results = run_greedy(pool, make_plan(model_dir, 2, 2), model_dir, [PROMPT], env=env)
    assert [r["shared_memory"] for r in results] == [shared_memory] * 4
    assert_matches_hf(results, hf_model(model_dir), [PROMPT])


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_tied_embeddings_and_llama3_rope(pool, checkpoint, hf_model, tp, pp):
    """A released-style config (rope_theta + llama3 rope_scaling) with tied embeddings: stored once
    when one stage embeds and projects, once per end stage otherwise."""
    model_dir = checkpoint("llama3-tied")
    plan = make_plan(model_dir, tp, pp)
    results = run_greedy(pool, plan, model_dir, [PROMPT])
    assert_matches_hf(results, hf_model(model_dir), [PROMPT])
    for rank, rep in enumerate(results[0]["reports"]):  # in rank order
        assert rep["allocated_bytes"]["weights"] == plan.rank_plan(0, rank).predicted_bytes.weights, rank


def test_one_kv_head_copied_to_every_tp_rank(pool, checkpoint, hf_model):
    model_dir = checkpoint("llama-mqa")
    results = run_greedy(pool, make_plan(model_dir, 4, 1), model_dir, [PROMPT])
    assert_matches_hf(results, hf_model(model_dir), [PROMPT])


def test_uneven_three_stages(pool, checkpoint, hf_model):
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 1, 3, partition=[2, 1, 1])
    assert [tuple(s.layers) for s in plan.stages] == [(0, 2), (2, 3), (3, 4)]
    results = run_greedy(pool, plan, model_dir, [PROMPT])
    assert_matches_hf(results, hf_model(model_dir), [PROMPT])
    # what each stage sent, the next one received (and the last sent tokens back to the first)
    sent = [r["comm_bytes"]["send"] for r in results[0]["reports"]]
    received = [r["comm_bytes"]["recv"] for r in results[0]["reports"]]
    assert sent == [received[1], received[2], received[0]] and min(sent) > 0
    assert all(r["idle_seconds"] > 0 and r["compute_seconds"] > 0 for r in results[0]["reports"][1:])


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)])
def test_batch_of_prompts_of_different_lengths(pool, checkpoint, hf_model, tp, pp):
    """Left-padded rows, prefilled in micro-batches on two stages, each equal to its own HF run."""
    model_dir = checkpoint("llama")
    prompts = [PROMPT, [5, 6, 7], PROMPT[::-1] + [1, 2, 3]]
    results = run_greedy(pool, make_plan(model_dir, tp, pp, batch=3), model_dir, prompts)
    assert_matches_hf(results, hf_model(model_dir), prompts)
