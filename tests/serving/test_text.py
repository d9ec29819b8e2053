"""The one detokenizer and stop-string cutter (`text.py`): streamed deltas that never need taking
back and add up to the final text, the ids cut at the token that completed a stop string, a
window that decodes a few tokens a step (not the whole sequence), and a tokenizer that fails
failing its sequence alone. Checked against a toy decoder and the demo model's BPE tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shard_contract.wire import Completion
from shard_worker.serving.text import TextStream, find_stop
from shard_worker.serving.tokenizer import TextCodec


def chars(ids: list[int]) -> str:
    """A decoder where token i is chr(i)."""
    return "".join(chr(i) for i in ids)


def utf8(ids: list[int]) -> str:
    """A decoder of one token per byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def stream_all(decode, tokens: list[int], stops: list[str], reason: str = "length") -> tuple[list[str], Completion]:
    """Each step's delta, the last one, and the final completion."""
    stream = TextStream(decode, stops)
    deltas = []
    for n in range(1, len(tokens) + 1):
        deltas.append(stream.step(tokens[:n])[0])
        if stream.stopped:
            break
    final = stream.finish(Completion(token_ids=tokens, finish_reason=reason))
    deltas.append(stream.rest(final)[0])
    return deltas, final


def test_streamed_text_holds_back_what_may_be_a_stop_string():
    deltas, final = stream_all(chars, [ord(c) for c in "hello wor"], ["wor!"])
    assert "".join(deltas) == final.text == "hello wor"
    assert deltas[5:9] == [" ", "", "", ""]  # "w", "wo", "wor" might begin "wor!"
    assert deltas[-1] == "wor"  # the sequence ended: nothing can follow
    assert final.finish_reason == "length"


def test_text_stops_before_the_stop_string_and_ids_at_the_token_that_completed_it():
    tokens = [ord(c) for c in "abcSTOPdef"]
    deltas, final = stream_all(chars, tokens, ["STOP"])
    assert "".join(deltas) == final.text == "abc"
    assert final.token_ids == tokens[:7] and final.finish_reason == "stop"


def test_a_stop_string_split_across_steps_and_the_earliest_of_several():
    stream = TextStream(chars, ["cd", "bcx", "zz"])
    assert stream.step([ord("a"), ord("b")]) == ("a", [97, 98])  # "b" may begin "bcx"
    assert stream.step([97, 98, 99]) == ("", [99])  # "bc" may begin "bcx"; "c" may begin "cd"
    stream.step([97, 98, 99, 100])
    assert stream.stopped and stream.text == "ab"


def test_streamed_text_waits_for_a_whole_character():
    stream = TextStream(utf8, [])
    assert stream.step([0x61, 0xC3]) == ("a", [0x61, 0xC3])  # "a" and the first byte of "é"
    assert stream.step([0x61, 0xC3, 0xA9]) == ("é", [0xA9])


def test_without_a_tokenizer_only_ids_stream():
    stream = TextStream(None, [])
    assert stream.step([4, 5]) == ("", [4, 5])
    assert stream.step([4, 5, 6]) == ("", [6])
    final = stream.finish(Completion(token_ids=[4, 5, 6, 7], finish_reason="length"))
    assert final.text is None and stream.rest(final) == ("", [7])


def test_each_step_decodes_a_window_not_the_whole_sequence():
    decoded: list[int] = []

    def counting(ids: list[int]) -> str:
        decoded.append(len(ids))
        return chars(ids)

    stream = TextStream(counting, ["zz"])
    tokens = [ord("a")] * 2000
    for n in range(1, len(tokens) + 1):
        stream.step(tokens[:n])
    assert max(decoded) <= 2 and stream.text == "a" * 2000


def test_a_tokenizer_that_fails_fails_its_sequence_alone():
    def broken(ids: list[int]) -> str:
        if len(ids) > 1 or (ids and ids[0] == 7):
            raise RuntimeError("the tokenizer broke")
        return chars(ids)

    stream = TextStream(broken, [])
    stream.step([65, 7])
    assert stream.stopped and "decoding its tokens failed: RuntimeError" in (stream.error or "")
    final = stream.finish(Completion(token_ids=[65, 7], finish_reason="length"))
    assert final.finish_reason == "error" and "the tokenizer broke" in (final.error or "")


def test_an_engine_failure_passes_through():
    failed = Completion(token_ids=[1], finish_reason="error", error="sampling failed")
    assert TextStream(chars, ["x"]).finish(failed) == failed


@pytest.fixture(scope="module")
def codec(tiny_model) -> TextCodec:
    loaded = TextCodec.load(tiny_model)
    assert loaded is not None
    return loaded


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_with_a_real_tokenizer_the_deltas_add_up_to_the_decoded_text(codec, data):
    vocab = codec.tokenizer.get_vocab_size()
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
    whole = codec.decode(tokens)
    stop = data.draw(st.sampled_from(["", whole[len(whole) // 2:len(whole) // 2 + 3], "\u2603"]))
    assume("\ufffd" not in stop)  # half a character is no stop string a client can send
    stops = [stop] if stop else []
    deltas, final = stream_all(codec.decode, tokens, stops)
    assert "".join(deltas) == final.text
    assert final.token_ids == tokens[:len(final.token_ids)]
    if find_stop(whole, stops) is None:
        assert (final.text, final.token_ids, final.finish_reason) == (whole, tokens, "length")
    else:  # cut before the stop string, the ids at the token that completed it
        kept = final.token_ids
        assert final.finish_reason == "stop" and stop in codec.decode(kept) and stop not in codec.decode(kept[:-1])
        assert final.text == codec.decode(kept)[:codec.decode(kept).find(stop)]


def test_a_stream_behind_the_engine_catches_up_with_its_freshest_event():
    import asyncio

    from shard_worker.serving.events import Done, Failed, Step
    from shard_worker.serving.routes import latest

    async def drained(events: list) -> tuple:
        queue: asyncio.Queue = asyncio.Queue()
        for event in events[1:]:
            queue.put_nowait(event)
        return latest(queue, events[0]), queue.qsize()

    done = Done(Completion(token_ids=[1, 2, 3], finish_reason="length"))
    assert asyncio.run(drained([Step([1]), Step([1, 2]), Step([1, 2, 3])])) == (Step([1, 2, 3]), 0)
    assert asyncio.run(drained([Step([1]), Step([1, 2]), done])) == (done, 0)
    assert asyncio.run(drained([Step([1]), Failed(503, "lost")])) == (Failed(503, "lost"), 0)
    assert asyncio.run(drained([done])) == (done, 0)
