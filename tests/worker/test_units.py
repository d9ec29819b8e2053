"""The worker's pure pieces: config reading, RoPE, masks, the prefill schedule, stopping (sampling:
test_sampling.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shard_contract.wire import GenerateRequest
from shard_worker.comm.dist import Topology
from shard_worker.engine.pipeline import prefill_units
from shard_worker.engine.sequences import SequenceState
from shard_worker.model.attention import CAUSAL, attention_mask
from shard_worker.model.config import ConfigError, ModelConfig
from shard_worker.model.step import rope_inv_freq
from shard_worker.serving.text import TextStream
from tests.support.checkpoints import LLAMA3_ROPE, hf_config

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}


# ---------------------------------------------------------------- config
def test_rope_spellings_agree():
    """transformers 5 writes rope_parameters; released checkpoints write rope_theta + rope_scaling."""
    scaling = {k: v for k, v in LLAMA3_ROPE.items()}
    new = ModelConfig.from_hf({**BASE, "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    old = ModelConfig.from_hf({**BASE, "rope_theta": 500000.0, "rope_scaling": scaling})
    assert new.rope == old.rope and new.rope["rope_type"] == "llama3"
    plain = ModelConfig.from_hf(BASE)
    assert plain.rope == {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope type 'yarn' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "needs low_freq_factor, high_freq_factor"),
])
def test_unsupported_rope_is_named(rope, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**BASE, "rope_scaling": rope}, source="m/config.json")


def test_biases_and_windows_per_family():
    qwen = ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert (qwen.qkv_bias, qwen.o_bias, qwen.mlp_bias) == (True, False, False)
    assert qwen.sliding_windows == (None, None)
    mistral = ModelConfig.from_hf({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 8})
    assert mistral.sliding_windows == (8, 8) and not mistral.qkv_bias
    layered = ModelConfig.from_hf({**BASE, "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]})
    assert layered.sliding_windows == (None, 8)


# Each config.json value a hostile or broken checkpoint held, that gave a traceback (exit 1, retried)
# or, for sliding_window "abc" and rope_theta -1, loaded: now one line naming the file and field.
BAD_FIELDS = [
    ({"rope_scaling": {**LLAMA3_ROPE, "factor": 1e308}}, r"rope_scaling: factor must be a number above 0"),
    ({"rope_scaling": {**LLAMA3_ROPE, "factor": 0}}, r"rope_scaling: factor must be a number above 0 .*\(got 0\)"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "x"}}, r"rope_scaling: factor must be a number .*\(got 'x'\)"),
    ({"rope_scaling": {**LLAMA3_ROPE, "high_freq_factor": 1.0}}, r"high_freq_factor \(1\) must be above low_freq"),
    ({"rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 8.5}},
     r"rope_scaling: original_max_position_embeddings must be an integer"),
    ({"rope_scaling": "x"}, r"rope_scaling must be a JSON object or null \(got 'x'\)"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}},
     r"rope_parameters: rope_theta must be a number above 1"),
    ({"rope_theta": "abc"}, r"m/config\.json: rope_theta must be a number above 1 .*\(got 'abc'\)"),
    ({"rope_theta": -1}, r"rope_theta must be a number above 1 and at most 1e\+12 \(got -1\)"),
    ({"rope_theta": float("nan")}, r"rope_theta must be a number"),
    ({"rms_norm_eps": "abc"}, r"rms_norm_eps must be a number above 0 and at most 1 \(got 'abc'\)"),
    ({"rms_norm_eps": 0}, r"rms_norm_eps must be a number above 0"),
    ({"eos_token_id": "abc"}, r"eos_token_id must be a token id from 0 to 99 .*\(got 'abc'\)"),
    ({"eos_token_id": [1, 100]}, r"eos_token_id must be a token id from 0 to 99"),
    ({"eos_token_id": -1}, r"eos_token_id must be a token id"),
    ({"sliding_window": "abc"}, r"sliding_window must be an integer from 1 to \d+ \(got 'abc'\)"),
    ({"sliding_window": 0}, r"sliding_window must be an integer from 1"),
    ({"sliding_window": 8, "layer_types": ["full_attention"]}, r"layer_types must list one of .* for each of the 2"),
    ({"sliding_window": 8, "layer_types": ["full_attention", "x"]}, r"layer_types must list one of"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"sliding_attention layers but sliding_window is not"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": "yes", "sliding_window": 4},
     r"use_sliding_window must be true or false"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 9},
     r"max_window_layers must be an integer from 0 to 2"),
    ({"hidden_act": ["silu"]}, r"hidden_act \['silu'\] is not supported"),
]


@pytest.mark.parametrize("fields,message", BAD_FIELDS)
def test_every_config_field_is_checked_where_it_is_read(fields, message):
    from shard_contract.checkpoint import CheckpointError

    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig.from_hf({**BASE, **fields}, source="m/config.json")
    assert str(err.value).startswith("m/config.json") and "\n" not in str(err.value)
    assert isinstance(err.value, CheckpointError)  # the no-retry exit: shard_worker.__main__.PERMANENT_ERRORS


def test_generation_config_eos_ids_are_checked_naming_that_file(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, "x"]}))
    with pytest.raises(ConfigError, match=r"generation_config\.json: eos_token_id must be a token id"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2, 3)


def test_valid_numbers_of_every_checked_kind_are_kept():
    config = ModelConfig.from_hf({**BASE, "rms_norm_eps": 1e-5, "eos_token_id": [1, 2], "rope_theta": 500000,
                                  "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]})
    assert (config.rms_norm_eps, config.eos_token_ids, config.rope["rope_theta"]) == (1e-5, (1, 2), 500000.0)
    assert config.sliding_windows == (8, None)


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"rope_type": "linear", "factor": 4.0}, LLAMA3_ROPE])
def test_inverse_frequencies_equal_hf(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_config("llama", rope_scaling=rope, hidden_size=128, num_heads=4)  # head_dim 32: every band
    ours = rope_inv_freq(ModelConfig.from_hf({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]}))
    if rope["rope_type"] == "default":
        expected = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


# ---------------------------------------------------------------- masks and schedule
@given(pads=st.lists(st.integers(0, 5), min_size=1, max_size=3), c0=st.integers(0, 8), width=st.integers(1, 4),
       window=st.one_of(st.none(), st.integers(1, 6)))
def test_attention_mask_brute_force(pads, c0, width, window):
    c1 = c0 + width
    mask = attention_mask(torch.tensor(pads), c0, c1, window)
    for b, pad in enumerate(pads):
        for qi, q in enumerate(range(c0, c1)):
            for k in range(c1):
                visible = k <= q and (k >= pad or k == q) and (window is None or q - k < window)
                if mask is None or mask == CAUSAL:  # SDPA's is_causal is top-left aligned: q - c0 >= k
                    got = mask is None or q - c0 >= k
                else:
                    got = bool(mask[b, 0, qi, k])
                assert got == visible, (b, q, k)


@pytest.mark.parametrize("pads, c0, c1, window, kind", [
    ([0, 0], 5, 6, None, None),  # a decode step: nothing to mask
    ([0, 0], 0, 6, None, CAUSAL),  # a prefill from column 0: SDPA's is_causal, no mask
    ([0, 0], 0, 6, 8, CAUSAL),  # a window that does not bite yet
    ([0, 0], 4, 6, None, "mask"),  # a later chunk: causal aligned bottom-right, a mask
    ([0, 2], 0, 6, None, "mask"),  # padding
    ([0, 2], 5, 6, None, "mask"),
    ([0, 0], 9, 10, 4, "mask"),  # the window bites
])
def test_the_mask_is_left_out_where_sdpa_can_do_without(pads, c0, c1, window, kind):
    mask = attention_mask(torch.tensor(pads), c0, c1, window)
    assert (mask if not isinstance(mask, torch.Tensor) else "mask") == kind


@given(batch=st.integers(1, 7), cols=st.integers(1, 40), stages=st.integers(1, 4), chunk=st.integers(1, 16),
       max_rows=st.none() | st.integers(1, 8))
def test_prefill_units_cover_each_cell_once_in_order(batch, cols, stages, chunk, max_rows):
    units = prefill_units((0, batch), (0, cols), stages, chunk, max_rows)
    seen = {}
    for i, u in enumerate(units):
        assert u.cols <= chunk
        assert max_rows is None or u.rows <= max_rows  # no pass larger than the plan sized activations for
        for r in range(u.r0, u.r1):
            for c in range(u.c0, u.c1):
                assert (r, c) not in seen
                seen[(r, c)] = i
    assert len(seen) == batch * cols
    for r in range(batch):  # each row's columns are processed left to right
        order = [seen[(r, c)] for c in range(cols)]
        assert order == sorted(order)
    assert len(units) >= min(stages, batch * cols)
    assert [u.c1 == cols for u in units] == [u.emits for u in units]
    assert sum(u.emits for u in units) == len({(u.r0, u.r1) for u in units})  # each micro-batch's last chunk


def test_a_joiners_prefill_fills_its_row_from_its_padding_to_the_decode_column():
    units = prefill_units((3, 4), (7, 12), stages=2, chunk=3)
    assert [(u.r0, u.r1, u.c0, u.c1, u.emits) for u in units] == [(3, 4, 7, 10, False), (3, 4, 10, 12, True)]


def test_topology_neighbours():
    t = Topology(rank=5, tp=2, pp=3)  # stage 2, tp_rank 1
    assert (t.stage, t.tp_rank, t.is_last, t.prev, t.next, t.first, t.last) == (2, 1, True, 3, None, 1, 5)
    assert Topology(rank=0, tp=2, pp=3).stage_ranks(1) == [2, 3]


# ---------------------------------------------------------------- stopping
class WordTokenizer:
    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


@pytest.mark.parametrize("request_args,tokens,kept,reason,text", [
    ({"max_new_tokens": 3}, [5, 6, 7, 8], [5, 6, 7], "length", "w5 w6 w7"),
    ({"max_new_tokens": 9}, [5, 2, 7], [5, 2], "stop", "w5 w2"),  # EOS (2) kept, then stop
    ({"max_new_tokens": 9, "ignore_eos": True}, [5, 2, 7], [5, 2, 7], "length", "w5 w2 w7"),
    ({"max_new_tokens": 9, "stop_token_ids": [6]}, [5, 6, 7], [5, 6], "stop", "w5 w6"),
    ({"max_new_tokens": 9, "stop": ["w6 w7"]}, [5, 6, 7, 8], [5, 6, 7], "stop", "w5 "),
])
def test_sequence_stops(request_args, tokens, kept, reason, text):
    """The engine stops a sequence on its ids and its length; the text side (`text.py`) on a stop
    string, which it cuts the text before."""
    request = GenerateRequest(prompt_ids=[1], **request_args)
    seq, stream = SequenceState(request, eos_ids=(2,)), TextStream(WordTokenizer().decode, request.stop)
    for t in tokens:
        seq.add(t)
        stream.step(seq.tokens)
        if stream.stopped:  # stopped as a cancelled sequence is, at the next step boundary
            break
    done = stream.finish(seq.completion())
    if reason == "length" and len(kept) < request_args["max_new_tokens"]:
        assert seq.finish_reason is None  # still running
    else:
        assert (done.token_ids, done.finish_reason, done.text) == (kept, reason, text)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_planners_attention_workspace_is_what_the_masked_path_allocates(checkpoint, tp):
    """The worst masked step (the whole batch, padded rows, maxModelLen columns within one prefill
    chunk): the boolean mask, its additive copy and that copy repeated over each KV head's query
    heads are the bytes shard_operator.planning.sizing budgets for attention (the K/V are read in
    place)."""
    from shard_operator.planning.profile import profile_model
    from shard_operator.planning.sizing import attention_workspace_bytes
    from shard_worker.model.slices import Layout
    from shard_worker.model.step import Rotary, Step

    model_dir = checkpoint("llama")  # 4 heads, 2 KV heads: at TP=4 one of each per rank
    config, batch, max_len, cpu = ModelConfig.from_dir(model_dir), 3, 40, torch.device("cpu")
    layout = Layout(config, tp=tp, tp_rank=0, layers=(0, 1), embeds=True, has_lm_head=True)
    step = Step.build(0, batch, 0, max_len, torch.tensor([0, 3, 7]), Rotary(config, max_len, cpu), {None},
                      torch.float32, cpu)
    mask, group = step.masks[None], layout.heads // layout.kv_heads
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.float32
    grouped = mask.numel() * group * mask.element_size() if group > 1 else 0
    allocated = mask.numel() * (1 + mask.element_size()) + grouped  # boolean, additive, repeated over the group
    assert attention_workspace_bytes(profile_model(model_dir), tp, max_len, batch, "float32") == allocated


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_planners_gathered_kv_is_what_the_torch_path_copies_out_of_the_pool(checkpoint, tp):
    """A pass that is not a first chunk (here the last chunk of a maxModelLen prompt, every row)
    reads its rows' whole context out of the paged pool where the torch path gathers (a CPU rank's
    later prefill chunk, the compiled step): those copies of the keys and values are the bytes
    shard_operator.planning.sizing budgets for them."""
    from shard_operator.planning.profile import profile_model
    from shard_operator.planning.sizing import gathered_kv_bytes
    from shard_worker.model.slices import Layout
    from shard_worker.model.step import KVCache, Rotary, Step

    model_dir = checkpoint("llama")
    config, batch, max_len, cpu = ModelConfig.from_dir(model_dir), 3, 40, torch.device("cpu")
    layout = Layout(config, tp=tp, tp_rank=0, layers=(0, 1), embeds=True, has_lm_head=True)
    cache = KVCache(1, batch, layout.kv_heads, max_len, config.head_dim, torch.float32, cpu)
    step = Step.build(0, batch, max_len - 8, max_len, torch.zeros(batch, dtype=torch.int64),
                      Rotary(config, max_len, cpu), {None}, torch.float32, cpu)
    new = torch.ones(batch, layout.kv_heads, 8, config.head_dim)
    cache.update(0, step, new, new)
    keys, values = cache.gather(0, step)  # the copy a gathering pass makes (paged.py reads in place instead)
    assert keys.shape[2] == max_len  # the whole context, not the chunk's own
    copied = keys.untyped_storage().nbytes() + values.untyped_storage().nbytes()
    assert copied < cache.nbytes  # a copy of the rows' columns, not a view of the pool
    assert gathered_kv_bytes(profile_model(model_dir), tp, max_len, batch, "float32", "cpu") == copied
