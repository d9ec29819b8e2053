"""The loader's staging for a GPU destination: two pinned buffers in turn, a buffer reused only
once its previous copy is done, every copy done when the reader closes, and every copy already in
the destination's dtype (converted or quantized on the CPU first). No GPU here: the buffers are
not pinned and a fake event records the order; the bytes that land are checked for real."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from shard_worker.model.config import ModelConfig
from shard_worker.model.loader import Checkpoint, LoadStats, PinnedStaging, SliceReader
from shard_worker.model.slices import Piece


class Events:
    """CUDA events as a log: record() after a copy, synchronize() before a buffer is reused."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.made = 0

    def __call__(self) -> Events._Event:
        self.made += 1
        return Events._Event(self, self.made)

    class _Event:
        def __init__(self, log: Events, number: int):
            self.events, self.number = log, number

        def record(self) -> None:
            self.events.log.append(("record", self.number))

        def synchronize(self) -> None:
            self.events.log.append(("synchronize", self.number))


def test_two_buffers_in_turn_each_reused_after_its_copy_and_all_done_at_close(checkpoint):
    model_dir = checkpoint("llama")
    config = ModelConfig.from_dir(model_dir)
    entry = Checkpoint(model_dir, config).entry("model.layers.0.mlp.down_proj.weight")  # [64, 128] float32
    rows, cols = entry.shape
    events = Events()
    # 4 rows of 64 columns per chunk: 16 chunks through two buffers of 1 KiB (float32 -> bfloat16 converts)
    staging = PinnedStaging(4 * 64 * 4, pinned=False, event=events)
    dst = torch.zeros(rows, cols // 2, dtype=torch.bfloat16)
    with SliceReader(LoadStats(), staging) as reader:
        reader.read(entry, Piece(entry.name, 1, 64, 128), dst)  # the second half of the columns
        assert staging.turn == 0  # 16 turns, alternating
    with safe_open(str(entry.path), "pt") as f:
        expected = f.get_tensor(entry.name)[:, 64:].to(torch.bfloat16)
    assert torch.equal(dst, expected)
    copies = [n for what, n in events.log if what == "record"]
    assert len(copies) == 16
    # before copy k + 2 reuses copy k's buffer, copy k's event is waited for
    for k in range(2, 16):
        assert events.log.index(("synchronize", copies[k - 2])) < events.log.index(("record", copies[k]))
    # closing the reader waits for the last copy of each buffer
    assert events.log[-2:] == [("synchronize", copies[14]), ("synchronize", copies[15])]


class SameDtype(PinnedStaging):
    """Pinned staging that records the dtypes of every copy it makes."""

    def __init__(self, nbytes: int, events: Events):
        super().__init__(nbytes, pinned=False, event=events)
        self.copied: list[tuple[torch.dtype, torch.dtype]] = []

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.copied.append((src.dtype, dst.dtype))
        super().copy(src, dst)


@pytest.mark.parametrize("piece, dtype, quantized", [
    (Piece("model.layers.0.mlp.down_proj.weight", 0, 16, 64), torch.float32, False),  # rows, no conversion
    (Piece("model.layers.0.mlp.down_proj.weight", 1, 64, 128), torch.float32, False),  # columns
    (Piece("model.layers.0.mlp.down_proj.weight", 1, 64, 128), torch.bfloat16, False),  # converted
    (Piece("model.layers.0.mlp.down_proj.weight", 0, 16, 64), torch.int8, True),  # quantized rows
    (Piece("model.layers.0.mlp.down_proj.weight", 1, 64, 128), torch.int8, True),  # quantized, whole rows' scales
])
def test_a_gpu_destination_gets_what_a_cpu_one_does_in_same_dtype_copies(checkpoint, piece, dtype, quantized):
    """The decode path's conversions on the CPU (bounded, through the mapped staging area) feed the
    pinned buffers: what lands is bit for bit the CPU path's, each copy in the destination's dtype."""
    model_dir = checkpoint("llama")
    entry = Checkpoint(model_dir, ModelConfig.from_dir(model_dir)).entry(piece.tensor)
    rows = piece.stop - piece.start if piece.dim == 0 else entry.shape[0]
    width = entry.shape[1] if piece.dim == 0 else piece.stop - piece.start

    def load(pinned: PinnedStaging | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        dst, scale = torch.zeros(rows, width, dtype=dtype), torch.zeros(rows) if quantized else None
        with SliceReader(LoadStats(), pinned) as reader:
            assert reader.read(entry, piece, dst, scale) == rows
        return dst, scale

    events = Events()
    staging = SameDtype(8 * 128 * 4, events)  # 8 whole rows of float32 a buffer
    on_cpu, on_gpu = load(None), load(staging)
    assert torch.equal(on_gpu[0], on_cpu[0]) and on_cpu[0].abs().sum() > 0
    if quantized:
        assert torch.equal(on_gpu[1], on_cpu[1]) and bool((on_cpu[1] > 0).all())
    # a chunk's rows fill the staging: float32 as read (the checkpoint's), or whole float32 rows to quantize
    per_chunk = staging.nbytes // (4 * (entry.shape[1] if quantized else width))
    chunks = -(-rows // per_chunk)
    assert staging.copied == [(t, t) for _ in range(chunks) for t in ([torch.float32, dtype] if quantized else [dtype])]
    assert len(events.log) == 2 * len(staging.copied)  # each copy recorded, and waited for once
