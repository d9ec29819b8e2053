"""llama.cpp as the decode peer of bench/decode.py: convert a random Llama checkpoint to GGUF and
time llama.cpp's decode of it. Runs in its own virtualenv (numpy, gguf, llama-cpp-python), never
in the project's: llama-cpp-python builds llama.cpp from source, which takes a long while on two
cores. Set it up once, outside the repository:

    python3 -m venv ~/.cache/shard-operator/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_RPC=ON -DLLAVA_BUILD=OFF" nice \\
        ~/.cache/shard-operator/llamacpp-venv/bin/pip install llama-cpp-python gguf numpy

Where llama.cpp's own tree is already built with shared libraries (bench/serve_peer.py's
llama-server build in ~/.cache/shard-operator/server-build is llama-cpp-python's vendored tree),
the build can be skipped: install gguf and numpy, copy the sdist's `llama_cpp` package into the
venv's site-packages and that build's `bin/*.so*` into `llama_cpp/lib` (seconds, not half an hour).

And, for the layer split over two processes (llama.cpp's RPC backend), its `ggml-rpc-server`:

    cmake -S <llama-cpp-python sdist>/vendor/llama.cpp -B ~/.cache/shard-operator/rpc-build \\
        -DGGML_RPC=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
    cmake --build ~/.cache/shard-operator/rpc-build --target ggml-rpc-server

Usage (bench/decode.py does this):
    python llamacpp_peer.py convert MODEL_DIR {F32,BF16,Q8_0}      -> prints {"path", "decode_bytes"}
    python llamacpp_peer.py convert-vocab MODEL_DIR KIND            (with its tokenizer.json: llama-server)
    python llamacpp_peer.py time GGUF THREADS TOKENS PROMPT_IDS [RPC_SERVER LAYERS_THERE]
                                                                   -> prints {"seconds_per_token", ...}

The conversion is our own small writer (the gguf package's `GGUFWriter` and quantizers): the
project's converter wants a real tokenizer, which the random model lacks; the vocabulary is
written as llama.cpp's "none" type (token ids only). Q/K rows are permuted to llama.cpp's RoPE
layout, as its converter does. Q8_0 quantizes every matrix, the embeddings and LM head too (what
its converter's `--outtype q8_0` does).
"""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import numpy as np


def read_safetensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor as float32 (memory-mapped when stored as float32)."""
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out = {}
    for file in files:
        path = model_dir / file
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, stop = info["data_offsets"]
            raw = data[start:stop]
            if info["dtype"] == "F32":
                array = raw.view(np.float32)
            elif info["dtype"] == "BF16":
                array = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif info["dtype"] == "F16":
                array = raw.view(np.float16).astype(np.float32)
            else:
                raise SystemExit(f"{path}: tensor {name} has dtype {info['dtype']}")
            out[name] = array.reshape(info["shape"])
    return out


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half rows of q/k -> llama.cpp's interleaved pairs (its converter's permute)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def add_vocab(writer, gguf, model_dir: Path, vocab_size: int) -> None:
    """The model's byte-level BPE tokenizer.json as llama.cpp's "gpt2" vocabulary (ids past the
    tokenizer's, up to the model's vocab_size, as unused padding tokens, as its converter writes
    them): llama-server detokenizes what it streams, which the "none" vocabulary cannot."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    added = {t["id"]: t for t in tok.get("added_tokens", [])}
    by_id = {i: s for s, i in tok["model"]["vocab"].items()} | {i: t["content"] for i, t in added.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(gguf.TokenType.UNUSED if i not in by_id else
                     gguf.TokenType.CONTROL if added.get(i, {}).get("special") else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    config = json.loads((model_dir / "config.json").read_text())
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0]
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(False)  # the prompts are token ids, sent whole


def convert(model_dir: Path, kind: str, vocab: bool = False) -> dict:
    import gguf

    target = model_dir / "gguf" / f"{kind}{'-vocab' if vocab else ''}.gguf"
    facts = target.with_suffix(".json")
    if target.exists() and facts.exists():
        return json.loads(facts.read_text())
    config = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    quant = getattr(gguf.GGMLQuantizationType, kind)
    target.parent.mkdir(exist_ok=True)
    writer = gguf.GGUFWriter(str(target), "llama")
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(config["vocab_size"])
    if vocab:
        add_vocab(writer, gguf, model_dir, config["vocab_size"])
    else:
        writer.add_tokenizer_model("none")  # token ids only: the random model has no tokenizer
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
                          "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    decode_bytes = 0
    for name, array in read_safetensors(model_dir).items():
        if name in names:
            ours = names[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            ours = f"blk.{layer}.{parts[rest.removesuffix('.weight')]}.weight"
        if ".attn_q." in ours:
            array = permute(array, heads)
        elif ".attn_k." in ours:
            array = permute(array, kv_heads)
        if array.ndim == 1 or kind == "F32":  # norms stay float32, as llama.cpp wants
            data, raw = np.ascontiguousarray(array, dtype=np.float32), gguf.GGMLQuantizationType.F32
        else:
            data, raw = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), quant), quant
        writer.add_tensor(ours, data, raw_dtype=raw)
        if ours != "token_embd.weight":  # a decode step reads every tensor but one embedding row
            decode_bytes += data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = {"path": str(target), "decode_bytes": decode_bytes}
    facts.write_text(json.dumps(out))
    return out


def time_decode(path: str, threads: int, tokens: int, prompt: list[int], rpc: str | None = None,
                rpc_layers: int = 0) -> dict:
    """Seconds per decoded token; with `rpc`, the first `rpc_layers` layers live in that
    ggml-rpc-server process (llama.cpp "offloads" them to it as to a GPU) and the rest here."""
    from llama_cpp import Llama

    kwargs = {"rpc_servers": rpc, "n_gpu_layers": rpc_layers} if rpc else {}
    llm = Llama(model_path=path, n_ctx=len(prompt) + tokens + 8, n_batch=8, n_threads=threads,
                n_threads_batch=threads, use_mmap=False, verbose=False, **kwargs)
    # The prompt goes in one token at a time: only decode is timed, and this build's AMX int8
    # path (Q8_0 with more than one token a batch) crashed on our machine.
    for token in prompt[:-1]:
        llm.eval([token])
    start = time.perf_counter()
    llm.eval(prompt[-1:])
    first = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(tokens - 1):  # the tokens fed do not change the work; a fixed cycle of ids
        llm.eval([prompt[i % len(prompt)]])
    seconds = time.perf_counter() - start
    return {"seconds_per_token": seconds / (tokens - 1), "first_token_seconds": first}


def main() -> int:
    what = sys.argv[1]
    if what in ("convert", "convert-vocab"):
        print(json.dumps(convert(Path(sys.argv[2]), sys.argv[3], vocab=what == "convert-vocab")))
    else:
        rpc = sys.argv[6:8] if len(sys.argv) > 7 else [None, 0]
        print(json.dumps(time_decode(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                     [int(t) for t in sys.argv[5].split(",")], rpc[0], int(rpc[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
