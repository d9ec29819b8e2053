"""One pipeline stage of a Llama-family decoder, tensor-parallel within the stage.

The stage holds only its layer range (`decoder.py`); the first stage embeds, the last applies the
final norm and the LM head. A decode step runs the resident layers fused where the C kernels
allow (`fused.py`), the others one by one, a streamed layer with the weights its streamer lends it
(`offload.py`). What the loader fills: every tensor this rank holds by our name (`Stage.tensors`),
and the checkpoint slices of each (`Stage.pieces`, by `slices.py`'s table).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch

from ..comm.dist import Comm
from .decoder import DecoderLayer
from .fused import FusedDecode
from .layers import ParallelLMHead, Projection, RMSNorm, VocabParallelEmbedding
from .slices import PROJECTIONS, Layout, Piece, check_tp, pieces
from .step import KVCache, Step


def _own_tensors(name: str, projection: Projection) -> dict[str, torch.Tensor]:
    """A projection's tensors by our name: its weight unless streamed (a streamed one holds none
    of its own: the streamer lends it blocks for a pass), its int8 scales and its bias if any."""
    out = {}
    if not projection.streamed:
        if not isinstance(projection.weight, torch.Tensor):
            raise RuntimeError(f"{name}: a resident projection holds one weight tensor, not row blocks")
        out[name + ".weight"] = projection.weight
    if projection.scale is not None:
        out[name + ".scale"] = projection.scale
    if projection.bias is not None:
        out[name + ".bias"] = projection.bias
    return out


class Stage:
    """`quantization` "int8": the decoder layers' projections hold int8 weights and per-row
    scales; embeddings, norms and the LM head stay in `dtype`."""

    def __init__(self, layout: Layout, comm: Comm, dtype: torch.dtype, device: torch.device,
                 quantization: str = "none", streamed: Iterable[int] = ()):
        check_tp(layout.config, layout.tp)
        c = layout.config
        self.layout, self.config, self.dtype, self.device = layout, c, dtype, device
        quantized = quantization == "int8"
        streamed = set(streamed)
        if streamed and quantized:
            raise ValueError("int8 layers cannot be streamed (they would be quantized again at every step)")
        if not streamed <= set(range(*layout.layers)):
            raise ValueError(f"streamed layers {sorted(streamed)} are not all in this stage's {list(layout.layers)}")
        self.embed = VocabParallelEmbedding(layout.vocab_start, layout.vocab_rows, c.hidden_size, comm, dtype,
                                            device) if layout.embeds else None
        self.layers = [DecoderLayer(layout, i, comm, dtype, device, quantized, i in streamed)
                       for i in range(*layout.layers)]
        self.streamer: Any = None  # lends streamed layers their weights (offload.Streamer)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device) if layout.has_lm_head else None
        self.lm_head = None
        if layout.has_lm_head:
            shared = self.embed.weight if self.embed is not None and layout.shares_embedding else None
            self.lm_head = ParallelLMHead(layout.vocab_rows, c.hidden_size, c.vocab_size, comm, dtype, device,
                                          weight=shared)
        self.windows = {c.sliding_windows[i] for i in range(*layout.layers)}
        self.fused = FusedDecode(comm)
        self.merged_passes = 0  # passes of several parts run as one fused pass (`forward_parts`)

    def forward(self, x: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        """Token ids [N, S] (first stage) or hidden states [N, S, H] -> hidden states [N, S, H]."""
        if self.embed is not None:
            x = self.embed(x)
        return self._layers(x, step, cache)

    def _layers(self, x: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        fused = self.fused.ready(x, step, cache)
        if fused:
            x = x.clone(memory_format=torch.contiguous_format)  # the fused layers update it in place
        for slot, layer in enumerate(self.layers):
            if fused and not layer.streamed and self.fused.run(layer, slot, x) is not None:
                continue
            with self.streamer.lend(layer) if layer.streamed else nullcontext():
                x = layer(x, step, cache, slot)
            if fused:
                x = x.contiguous()
        return x

    def forward_parts(self, parts: list[tuple[torch.Tensor, Step]], cache: KVCache) -> list[torch.Tensor]:
        """Several passes of this stage at once (`forward` of each, in order: a chunk of a prompt,
        then a decode step's rows, which read nothing the other writes): one fused pass where every
        layer runs fused, the tokens of all one row of x each, so each layer's weights are read
        once for all (`fused.py`); else each through `forward`. Their hidden states, each's shape."""
        xs = [self.embed(x) if self.embed is not None else x for x, _ in parts]
        if len(parts) == 1 or not (self.fused.ready_parts([(x, step) for x, (_, step) in zip(xs, parts, strict=True)],
                                                          cache)
                                   and self.fused.covers(self.layers, xs[0].dtype)):
            return [self._layers(x, step, cache) for x, (_, step) in zip(xs, parts, strict=True)]
        hidden = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs])  # its own copy, updated in place
        self.merged_passes += 1
        for slot, layer in enumerate(self.layers):
            self.fused.run(layer, slot, hidden)
        return [h.view(x.shape) for h, x in zip(hidden.split([x.shape[0] * x.shape[1] for x in xs]), xs, strict=True)]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, H] -> float32 logits [N, vocab] (last stage)."""
        if self.norm is None or self.lm_head is None:
            raise RuntimeError("logits come from the last stage (this one has no LM head)")
        return self.lm_head(self.norm(hidden))

    # ------------------------------------------------------------ what the loader fills
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this rank holds, by our name (tied embeddings appear once); an int8
        projection's scales are `<name>.scale` beside its `<name>.weight`."""
        out: dict[str, torch.Tensor] = {}
        if self.embed is not None:
            out["embed.weight"] = self.embed.weight
        for layer in self.layers:
            p = f"layers.{layer.index}."
            out[p + "input_norm.weight"], out[p + "post_norm.weight"] = layer.input_norm.weight, layer.post_norm.weight
            for name, module in (("qkv", layer.attn.qkv), ("o", layer.attn.o),
                                 ("gate_up", layer.mlp.gate_up), ("down", layer.mlp.down)):
                out.update(_own_tensors(p + name, module))
        if self.norm is not None:
            out["norm.weight"] = self.norm.weight
        if self.lm_head is not None and not self.layout.shares_embedding:
            out["lm_head.weight"] = self.lm_head.weight
        return out

    def streamed_pieces(self) -> dict[int, dict[str, list[Piece]]]:
        """For each streamed layer, the checkpoint slices of each of its projections (by the names
        of PROJECTIONS)."""
        table = self.pieces(streamed=True)
        return {layer.index: {name: table[f"layers.{layer.index}.{name}.weight"] for name in PROJECTIONS}
                for layer in self.layers if layer.streamed}

    def pieces(self, streamed: bool = False) -> dict[str, list[Piece]]:
        """The name-mapping table (`slices.pieces`) of this stage's tensors; with `streamed`, the
        streamed layers' projections too (which `tensors()` does not hold)."""
        return pieces(self.layout, () if streamed else [layer.index for layer in self.layers if layer.streamed])
