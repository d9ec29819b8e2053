"""The loader's staging for a GPU destination: two pinned buffers in turn, a buffer reused only
once its previous copy is done, every copy done when the reader closes. No GPU here: the buffers
are not pinned and a fake event records the order; the bytes that land are checked for real."""

from __future__ import annotations

import torch
from safetensors import safe_open

from shard_worker.config import ModelConfig
from shard_worker.loader import Checkpoint, LoadStats, PinnedStaging, SliceReader
from shard_worker.model import Piece


class Events:
    """CUDA events as a log: record() after a copy, synchronize() before a buffer is reused."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.made = 0

    def __call__(self) -> "Events._Event":
        self.made += 1
        return Events._Event(self, self.made)

    class _Event:
        def __init__(self, log: "Events", number: int):
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
