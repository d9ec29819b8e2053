"""How a step of a continuous batch is composed: the running decodes, and chunks of the prompts
of those who joined, under a per-step token budget. Pure Python, no torch.

Every step computes one token of each decoding row (the decode unit, one column) and then, with
what is left of the budget (`step_tokens` less the decoding rows), consecutive chunks of the
joiners' prompts, oldest joiner first. Decodes always run, and the prompts always get at least half
the budget (`prompt_tokens`): when the decodes alone fill it (64 streams on a CPU budget of 16) a
budget's worth is a floor, not a ceiling, or a joiner would creep one token a step, its first token
hundreds of steps away. By the budget's own measure (the prompt tokens that cost about one small
decode step, contract sharding.py) half a budget adds at most about half such a step to a step
already past it. A joiner's
prompt is computed by position (a chunk's unit has no padding: paging.py places KV by position,
so it does not matter at which column a chunk is computed); until its last chunk the row is
*parked*: its padding lies past every decode column, so the decode steps that compute it (it may
sit between decoding rows, and a replayed step computes every row of its bucket) write only TRASH
and sample nothing anyone keeps.

The chunk that ends a prompt emits the row's first token, and the row decodes from that step on.
Its prompt must end at the decode column (left padding, `Sequences`), which may be before or past
the batch's current column: the batch is *reframed* (`frame`): the decode column becomes the
largest next position of the rows that decode (theirs, and the joiner's prompt length), and every
decoding row's padding moves by the same amount. Positions do not change, so neither does any KV
or any answer. A frame is feasible when every row's remaining decode steps still end before
maxModelLen columns; when it is not, the joiner's last token waits (its prompt all but computed)
until enough rows have finished, and no younger joiner starts decoding before it. A joiner that
may generate one token only takes it from its last chunk and decodes in no step: it is not framed
(a prompt of maxModelLen tokens could never be: its decode column would be maxModelLen); its
padding is set past the decode column, so the step's decode unit, which computes its row before
the sequence ends, writes TRASH and reads nothing but itself, as for a parked row. When no row
decodes beside such joiners, that unit runs at column 0: the decode column of a step stays below
maxModelLen (every row it computes has a position there), and does not creep up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Prefill:
    """A joiner's prompt of `length` tokens in `row`, whose first `done` positions are computed
    (the prefix cache's, then each chunk's); it may generate `new` tokens."""

    row: int
    length: int
    done: int
    new: int

    @property
    def remaining(self) -> int:
        return self.length - self.done


@dataclass(frozen=True)
class Chunk:
    """Positions [start, end) of `row`'s prompt, computed this step; `last`: it ends the prompt."""

    row: int
    start: int
    end: int
    last: bool


def frame(positions: list[int], steps_left: list[int], max_len: int) -> int | None:
    """The decode column of a batch whose decoding rows' next positions are `positions` and which
    have `steps_left` decode steps each still to run: the largest position (so no row's padding is
    negative), or None when some row's last step would fall at or past column maxModelLen."""
    col = max(positions)
    return col if col + max(steps_left, default=1) - 1 <= max_len - 1 else None


def prompt_tokens(budget: int, decodes: int) -> int:
    """The prompt tokens of a step with `decodes` decoding rows under a budget of `budget` tokens:
    what the decodes leave, and at least half the budget (at least one token), so prefills always
    progress however many rows decode."""
    return max(budget - decodes, budget // 2, 1)


def plan_step(prefills: list[Prefill], decoding: dict[int, tuple[int, int]], col: int, budget: int,
              max_len: int) -> tuple[list[Chunk], int, dict[int, int]]:
    """This step's chunks, oldest joiner first, within `prompt_tokens(budget, decodes)`, given the
    decoding rows (row -> (next position, decode steps left)) at decode column `col`. Advances each
    prefill's `done`. Returns the chunks, the decode column after the joiners whose prompts end now
    are framed in, and the decoding rows' new paddings (row -> pad; the joiners' included: their
    prompts end at that column, or, for those whose one token is their last chunk's, it lies past it)."""
    left = prompt_tokens(budget, len(decoding))
    decoding = dict(decoding)
    chunks: list[Chunk] = []
    blocked = False  # an older joiner's last token waits: no younger one starts decoding before it
    done: list[int] = []  # joiners whose only token is their last chunk's: they decode in no step
    for p in prefills:
        if left <= 0:
            break
        n = min(p.remaining, left)
        last = n == p.remaining
        if last and p.new <= 1:
            done.append(p.row)
        elif last:
            rows = {**decoding, p.row: (p.length, max(1, p.new - 1))}
            framed = None if blocked else frame([q for q, _ in rows.values()], [s for _, s in rows.values()],
                                                max_len)
            if framed is None:
                blocked, last, n = True, False, n - 1
            else:
                decoding, col = rows, framed
        if n > 0:
            chunks.append(Chunk(p.row, p.done, p.done + n, last))
            p.done += n
            left -= n
    if done and not decoding:  # only rows that end now are computed by the decode step: any column will do
        col = 0
    pads = {row: col - position for row, (position, _) in decoding.items()}
    return chunks, col, pads | {row: col + 1 for row in done}
