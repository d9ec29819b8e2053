"""What a rank's log says of the requests it held when its engine raised (`engine/diagnosis.py`):
enough to send the killing request again, however long its prompt or schema."""

from __future__ import annotations

from shard_contract.wire import GenerateRequest
from shard_worker.engine.diagnosis import PROMPT_HEAD, request_summary, rows_summary
from shard_worker.engine.sequences import PARKED, Rows


def test_a_request_is_its_fields_that_differ_from_the_defaults_and_the_head_of_its_prompt():
    request = GenerateRequest(prompt_ids=list(range(3, 103)), max_new_tokens=7, temperature=0.5, top_k=2**64,
                              presence_penalty=-1.18, stop=["}", "\n"], ignore_eos=True)
    line = request_summary(request)
    assert line.startswith(f"prompt_ids={list(range(3, 3 + PROMPT_HEAD))}... (100 tokens)")
    for part in ("max_new_tokens=7", "temperature=0.5", f"top_k={2**64}", "presence_penalty=-1.18",
                 "stop=['}', '\\n']", "ignore_eos=True"):
        assert part in line, part
    assert "top_p" not in line and "seed" not in line  # defaults are left out
    schema = GenerateRequest(prompt_ids=[1], json_schema='{"type": "object"}' + " " * 1000)
    assert "...(1018 chars)" in request_summary(schema)


def test_the_rows_are_those_that_held_a_request_with_padding_blocks_and_first_position():
    a, b = GenerateRequest(prompt_ids=[1, 2]), GenerateRequest(prompt_ids=[5], max_new_tokens=3)
    rows = Rows(3, sampler=False, blocks_per_row=4)
    assert rows_summary(rows) == "  (no row holds a request)"
    rows.place(0, a, 0, [7, 9])
    rows.place(2, b, PARKED, [12], start=16)
    assert rows_summary(rows).splitlines() == [f"  row 0: pad 0, blocks [7, 9], start 0: {request_summary(a)}",
                                               f"  row 2: pad PARKED, blocks [12], start 16: {request_summary(b)}"]
