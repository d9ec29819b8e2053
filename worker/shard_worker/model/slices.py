"""Which slices of each checkpoint tensor this rank holds, and where they go.

`Layout` is this rank's share by the contract's sharding rules (`shard_contract.sharding`; the
planner sizes by the same), and `pieces()` turns it into the name-mapping table the loader
follows: destination tensor -> checkpoint tensors, slice, and destination row. Per rank, q/k/v are
one column-parallel matrix and gate/up another, so their pieces land side by side in one tensor.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shard_contract.sharding import kv_head_start, kv_heads_per_rank, tp_problem, vocab_rows_per_rank

from .config import ModelConfig


@dataclass(frozen=True)
class Layout:
    """This rank's share, by the contract's sharding rules (the planner sizes by them too):
    1/TP of the heads and MLP columns, ceil(kv/TP) KV heads, ceil(V/TP) vocabulary rows."""

    config: ModelConfig
    tp: int
    tp_rank: int
    layers: tuple[int, int]
    embeds: bool
    has_lm_head: bool

    @property
    def heads(self) -> int:
        return self.config.num_heads // self.tp

    @property
    def kv_heads(self) -> int:
        return kv_heads_per_rank(self.config, self.tp)

    @property
    def kv_head_start(self) -> int:
        return kv_head_start(self.config, self.tp, self.tp_rank)

    @property
    def intermediate(self) -> int:
        return self.config.intermediate_size // self.tp

    @property
    def vocab_rows(self) -> int:
        return vocab_rows_per_rank(self.config, self.tp)

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * self.vocab_rows

    @property
    def vocab_valid(self) -> int:
        """Rows of real vocabulary (the rest of the last rank's block is zero padding)."""
        return max(0, min(self.vocab_rows, self.config.vocab_size - self.vocab_start))

    @property
    def shares_embedding(self) -> bool:
        """Tied embeddings stored once: this stage both embeds and projects."""
        return self.config.tie_word_embeddings and self.embeds and self.has_lm_head


@dataclass(frozen=True)
class Piece:
    """Rows (dim 0) or columns (dim 1) [start, stop) of checkpoint `tensor`, written into the
    destination from row `offset` on."""

    tensor: str
    dim: int
    start: int
    stop: int
    offset: int = 0


def check_tp(config: ModelConfig, tp: int) -> None:
    problem = tp_problem(config, tp)
    if problem is not None:
        raise ValueError(f"this model cannot be split: {problem}")

PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a layer's matrices: what a streamed layer borrows


def pieces(layout: Layout, streamed: Iterable[int] = ()) -> dict[str, list[Piece]]:
    """The name-mapping table: for each tensor this rank holds (but int8 scales, which the loader
    computes beside their weights), the checkpoint slices that fill it. The layers in `streamed`
    hold no projection weights of their own (a streamer lends them theirs): those are left out."""
    lay, c = layout, layout.config
    hd, r = c.head_dim, lay.tp_rank
    q = (r * lay.heads * hd, (r + 1) * lay.heads * hd)
    kv = (lay.kv_head_start * hd, (lay.kv_head_start + lay.kv_heads) * hd)
    mlp = (r * lay.intermediate, (r + 1) * lay.intermediate)
    q_local, kv_local = q[1] - q[0], kv[1] - kv[0]
    table: dict[str, list[Piece]] = {}
    vocab = (lay.vocab_start, lay.vocab_start + lay.vocab_valid)
    if lay.embeds:
        table["embed.weight"] = [Piece("model.embed_tokens.weight", 0, *vocab)]
    for i in range(*lay.layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for kind in (("weight", "bias") if c.qkv_bias else ("weight",)):
            table[dst + f"qkv.{kind}"] = [
                Piece(src + f"self_attn.q_proj.{kind}", 0, *q),
                Piece(src + f"self_attn.k_proj.{kind}", 0, *kv, offset=q_local),
                Piece(src + f"self_attn.v_proj.{kind}", 0, *kv, offset=q_local + kv_local)]
        table[dst + "o.weight"] = [Piece(src + "self_attn.o_proj.weight", 1, *q)]
        for kind in (("weight", "bias") if c.mlp_bias else ("weight",)):
            table[dst + f"gate_up.{kind}"] = [
                Piece(src + f"mlp.gate_proj.{kind}", 0, *mlp),
                Piece(src + f"mlp.up_proj.{kind}", 0, *mlp, offset=lay.intermediate)]
        table[dst + "down.weight"] = [Piece(src + "mlp.down_proj.weight", 1, *mlp)]
        replicated = {"input_norm.weight": "input_layernorm.weight",
                      "post_norm.weight": "post_attention_layernorm.weight"}
        if c.o_bias:
            replicated["o.bias"] = "self_attn.o_proj.bias"
        if c.mlp_bias:
            replicated["down.bias"] = "mlp.down_proj.bias"
        for ours, theirs in replicated.items():
            size = c.tensor_shapes[src + theirs][0]
            table[dst + ours] = [Piece(src + theirs, 0, 0, size)]
    if lay.has_lm_head:
        table["norm.weight"] = [Piece("model.norm.weight", 0, 0, c.hidden_size)]
        if not lay.shares_embedding:
            source = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
            table["lm_head.weight"] = [Piece(source, 0, *vocab)]
    for index in streamed:
        for name in PROJECTIONS:
            del table[f"layers.{index}.{name}.weight"]
    return table
