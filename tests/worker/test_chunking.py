"""The composition of a continuous batch's steps (engine/chunking.py), as a pure model: the
joiners' prompts advance a chunk a step, oldest first, within the budget the decodes leave and by
at least half the budget however many rows decode; a prompt that ends is framed in so that no
padding is negative and every row still ends before maxModelLen; no position moves; every prompt
finishes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shard_worker.engine.chunking import Prefill, frame, plan_step, prompt_tokens


def test_frame_is_the_largest_position_when_every_row_still_fits():
    assert frame([5, 9, 3], [4, 1, 2], max_len=16) == 9
    assert frame([5, 9, 3], [7, 1, 2], max_len=16) == 9  # its last step at column 16 - 1
    assert frame([5, 9, 3], [8, 1, 2], max_len=16) is None


def test_a_prompt_is_cut_into_what_the_decodes_leave_of_the_budget():
    p = Prefill(row=2, length=10, done=0, new=4)
    decoding = {0: (6, 20), 1: (4, 20)}
    chunks, col, pads = plan_step([p], decoding, col=6, budget=5, max_len=64)
    assert [(c.row, c.start, c.end, c.last) for c in chunks] == [(2, 0, 3, False)]
    assert (col, pads) == (6, {0: 0, 1: 2})  # nothing framed in: the paddings stay
    chunks, col, pads = plan_step([p], decoding, col=7, budget=2, max_len=64)  # budget <= decodes: one token
    assert [(c.start, c.end) for c in chunks] == [(3, 4)]
    while p.remaining > 3:
        plan_step([p], decoding, col=7, budget=5, max_len=64)
    chunks, col, pads = plan_step([p], decoding, col=7, budget=5, max_len=64)
    assert [(c.start, c.end, c.last) for c in chunks] == [(7, 10, True)]
    assert col == 10 and pads == {0: 4, 1: 6, 2: 0}  # the 10-token prompt ends at column 10


def test_an_older_joiner_whose_last_token_cannot_be_framed_holds_it_and_the_younger_ones_back():
    old = Prefill(row=1, length=4, done=3, new=28)  # 4 + 28 - 1 columns: do not fit beside row 0
    young = Prefill(row=2, length=2, done=0, new=2)
    chunks, col, pads = plan_step([old, young], {0: (20, 10)}, col=20, budget=8, max_len=32)
    assert [(c.row, c.start, c.end, c.last) for c in chunks] == [(2, 0, 1, False)]
    assert (col, pads, old.done) == (20, {0: 0}, 3)
    chunks, col, pads = plan_step([old, young], {}, col=30, budget=8, max_len=32)  # row 0 has finished
    assert [(c.row, c.last) for c in chunks] == [(1, True), (2, True)]
    assert col == 4 and pads == {1: 0, 2: 2}  # reframed down: the batch starts over at column 4


def test_a_joiner_of_one_new_token_is_not_framed_so_a_prompt_of_max_len_tokens_ends():
    """Its one token is its last chunk's: no decode column is its, so a prompt of maxModelLen
    tokens (whose decode column would be maxModelLen: it waited forever) ends at once, beside
    decodes or alone, and moves no padding; the decode unit computes its row past its padding."""
    p = Prefill(row=1, length=32, done=24, new=1)
    chunks, col, pads = plan_step([p], {0: (20, 5)}, col=20, budget=16, max_len=32)
    assert [(c.row, c.start, c.end, c.last) for c in chunks] == [(1, 24, 32, True)]
    assert (col, pads) == (20, {0: 0, 1: 21})
    alone = Prefill(row=0, length=32, done=31, new=1)  # nothing decodes: its decode unit at column 0
    chunks, col, pads = plan_step([alone], {}, col=31, budget=16, max_len=32)
    assert [(c.row, c.last) for c in chunks] == [(0, True)] and (col, pads) == (0, {0: 1})


def test_prompts_take_what_the_decodes_leave_and_at_least_half_the_budget():
    assert [prompt_tokens(32, d) for d in (0, 8, 16, 17, 31, 32, 64)] == [32, 24, 16, 16, 16, 16, 16]
    assert [prompt_tokens(b, 5) for b in (1, 2, 3)] == [1, 1, 1]


def test_a_joiner_beside_more_decodes_than_the_budget_still_gets_half_the_budget_a_step():
    """64 streams decoding under a budget of 32: a 100-token prompt is done in 7 steps (16 tokens
    a step), not 100 (one token a step, all the decodes left of the budget)."""
    decoding = {row: (40, 500) for row in range(64)}
    p = Prefill(row=64, length=100, done=0, new=8)
    sizes = []
    for step in range(200):
        chunks, col, _ = plan_step([p], decoding, col=40 + step, budget=32, max_len=1024)
        sizes.append(sum(c.end - c.start for c in chunks))
        if chunks and chunks[-1].last:
            break
        decoding = {row: (q + 1, s - 1) for row, (q, s) in decoding.items()}
    assert sizes == [16] * 6 + [4] and col == 100 and p.done == 100


@st.composite
def batches(draw):
    max_len = draw(st.integers(8, 48))
    positions = [draw(st.integers(1, max_len - 1)) for _ in range(draw(st.integers(0, 4)))]
    # a feasible batch: the decode column at least every row's position, every row's last step before max_len
    col = draw(st.integers(max(positions, default=0), max_len - 1))
    decoding = {row: (q, draw(st.integers(1, max_len - col))) for row, q in enumerate(positions)}
    prefills = []
    for row in range(len(decoding), len(decoding) + draw(st.integers(1, 4))):
        length = draw(st.integers(1, max_len))  # maxModelLen tokens too (then for one new token)
        new = draw(st.integers(1, max_len - length + 1))
        prefills.append(Prefill(row, length, draw(st.integers(0, length - 1)), new))
    return max_len, decoding, col, prefills, draw(st.integers(1, 9))


@settings(max_examples=300, deadline=None)
@given(batches())
def test_every_step_keeps_the_budget_the_order_and_the_positions_and_every_prompt_ends(case):
    max_len, decoding, col, prefills, budget = case
    decoding = dict(decoding)
    waiting = list(prefills)
    for _ in range(10 * max_len + 100):
        if not waiting:
            break
        before = {p.row: p.done for p in waiting}
        share, remaining = prompt_tokens(budget, len(decoding)), sum(p.remaining for p in waiting)
        chunks, col, new_pads = plan_step(waiting, decoding, col, budget, max_len)
        took = sum(c.end - c.start for c in chunks)
        assert took <= max(budget - len(decoding), budget // 2, 1)
        # (no chunk at all: the oldest prompt's last token waits for rows to finish)
        assert chunks or waiting[0].remaining == 1
        rows = [c.row for c in chunks]
        assert rows == [p.row for p in waiting if p.row in rows]  # oldest first, one chunk each
        for c in chunks:
            assert c.start == before[c.row] and c.end <= next(p.length for p in waiting if p.row == c.row)
        # the rows that decoded keep their positions; the framed-in ones end their prompts at `col`
        for row, (q, _) in decoding.items():
            assert col - new_pads[row] == q
        framed = {c.row for c in chunks if c.last}
        for p in waiting:
            if p.row in framed and p.new == 1:  # its one token is its last chunk's: it decodes in no step
                assert new_pads[p.row] == col + 1 and p.done == p.length
            elif p.row in framed:
                assert new_pads[p.row] == col - p.length and p.done == p.length
                decoding[p.row] = (p.length, p.new - 1)
        assert all(pad >= 0 for pad in new_pads.values())
        assert all(col + s - 1 <= max_len - 1 for _, s in decoding.values())
        held = any(p.remaining == 1 for p in waiting if p.row not in framed)  # a last token waits
        assert took == min(share, remaining) or held  # the prompts take all of their share
        waiting = [p for p in waiting if p.row not in framed]
        if not (decoding or framed):
            continue  # no decode step: the column stays
        assert col <= max_len - 1  # every row a decode step computes has a position at its column
        # one decode step: each row's position moves on, the finished rows leave
        decoding = {row: (q + 1, s - 1) for row, (q, s) in decoding.items() if s > 1}
        col += 1
    assert not waiting, "some prompt never ended"
