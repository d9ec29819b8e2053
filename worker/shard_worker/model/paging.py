"""Where each cache column of a row lives in the paged KV cache: its block table, expanded.

The cache is a pool of fixed-size blocks (`BLOCK_SIZE` positions, every layer and KV head of this
rank). A row's *block table* lists its blocks: position p (p = column - the row's left padding)
lives in slot table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE. Two blocks are reserved:

- ZERO (block 0) is never written: the padding columns of a row read it, so what they multiply
  by 0 under the mask is 0 (0 x NaN would be NaN);
- TRASH (block 1) is never read as anyone's context: what must not land in a sequence's blocks
  is written there: padding columns, the positions a row took from the prefix cache (shared
  blocks are never rewritten), rows computed while no sequence holds them. A free row's table
  is all TRASH.

A forward pass expands its rows' tables once (`slot_maps`) into a read map (every column it
attends to) and a write map (the columns it computes); every layer then reads and writes through
them: the C kernel in place, torch by indexing the pool. Pure tensor functions, host or device;
`captured_maps` builds them from device tensors alone (a replayed decode step).
"""

from __future__ import annotations

import torch

from shard_contract.sharding import KV_BLOCK_SIZE as BLOCK_SIZE
from shard_contract.sharding import KV_RESERVED_BLOCKS as RESERVED_BLOCKS

ZERO_BLOCK, TRASH_BLOCK = 0, 1  # the RESERVED_BLOCKS, which the planner counts (and no sequence holds)


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-tokens // block_size)


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slot of each position [N, S] (>= 0) through the rows' tables [N, blocks]."""
    index = (positions // block_size).clamp(max=tables.shape[1] - 1)
    return tables.gather(1, index) * block_size + positions % block_size


def slot_maps(tables: torch.Tensor, pads: torch.Tensor, starts: torch.Tensor, c0: int, c1: int,
              block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows with block tables [N, blocks], left paddings [N] and first own positions `starts`
    [N] (the positions before are the prefix cache's), a pass over columns [c0, c1): the read map
    [N, c1] (padding -> ZERO) and the write map [N, c1 - c0] (padding and cached positions ->
    TRASH)."""
    positions = torch.arange(c1, device=tables.device).unsqueeze(0) - pads.unsqueeze(1)
    slots = _slots(tables, positions.clamp(min=0), block_size)
    read = torch.where(positions >= 0, slots, ZERO_BLOCK * block_size)
    own = positions[:, c0:] >= starts.unsqueeze(1)
    write = torch.where(own, slots[:, c0:], TRASH_BLOCK * block_size)
    return read, write


def captured_maps(tables: torch.Tensor, pads: torch.Tensor, column: torch.Tensor, length: int,
                  block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step at device column `column` [1] over `length` columns, from device tensors only:
    the read map [N, length] (padding and the columns past the step's -> ZERO: their stale values
    are masked, and 0 x NaN would be NaN) and the write map [N, 1]. A decode step's column is past
    every row's prompt, so no position it writes is the prefix cache's."""
    cols = torch.arange(length, device=tables.device).unsqueeze(0)
    positions = cols - pads.unsqueeze(1)
    slots = _slots(tables, positions.clamp(min=0), block_size)
    read = torch.where((positions >= 0) & (cols <= column), slots, ZERO_BLOCK * block_size)
    here = (column - pads).clamp(min=0).unsqueeze(1)
    write = torch.where(column >= pads.unsqueeze(1), _slots(tables, here, block_size), TRASH_BLOCK * block_size)
    return read, write


def contiguous_tables(rows: int, max_len: int, num_blocks: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Tables that give row r the blocks after row r - 1's, as an unpaged cache lays rows out
    (wrapping around a pool smaller than rows x max_len): what a pass without tables of its own
    uses (the warm-up's, and tests of the model alone)."""
    per_row = blocks_for(max_len, block_size)
    ids = torch.arange(rows * per_row, dtype=torch.int64).view(rows, per_row)
    return RESERVED_BLOCKS + ids % num_blocks
