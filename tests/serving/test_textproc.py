"""The leader's tokenizer processes (`textproc.py`): the same ids as the tokenizer in process, a
text too long for the context refused without tokenizing it, and a job that overruns its bound
(a huge text; a template that loops) failing alone while the event loop runs on and the next job
is served by a fresh process."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from shard_worker.serving.textproc import TextError, TextWorkers
from shard_worker.serving.tokenizer import TextCodec

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def codec(tiny_model) -> TextCodec:
    loaded = TextCodec.load(tiny_model)
    assert loaded is not None
    return loaded


def test_the_processes_give_the_tokenizers_ids(tiny_model, codec):
    workers = TextWorkers(str(tiny_model), timeout=60, max_chars=10_000)

    async def main() -> tuple[list[int], list[int], list[list[int]]]:
        many = await asyncio.gather(*(workers.encode(f"prompt number {i}") for i in range(6)))
        return await workers.encode("The quick brown fox"), await workers.encode_chat(CHAT), list(many)

    try:
        text, chat, many = asyncio.run(main())
    finally:
        workers.close()
    assert text == codec.encode("The quick brown fox")
    assert chat == codec.encode_chat(CHAT)
    assert many == [codec.encode(f"prompt number {i}") for i in range(6)]


def test_the_prompt_bound_counts_the_longest_token(codec):
    longest = max(len(t) for t in codec.tokenizer.get_vocab(with_added_tokens=True))
    assert codec.max_prompt_chars(100) == 100 * longest
    text = "the the the " * 200
    assert len(codec.encode(text)) <= len(text)  # and no text of n characters needs more than n / longest
    assert len(text) / longest <= len(codec.encode(text, add_special_tokens=False))


def test_a_rendered_conversation_longer_than_the_bound_is_refused(tiny_model):
    workers = TextWorkers(str(tiny_model), timeout=60, max_chars=50, workers=1)
    try:
        with pytest.raises(TextError) as err:
            asyncio.run(workers.encode_chat([{"role": "user", "content": "x" * 40}]))
    finally:
        workers.close()
    assert err.value.status == 400 and "50 characters" in str(err.value)


async def _while_ticking(job) -> tuple[BaseException | None, int]:
    """Run `job`, counting the event loop's turns meanwhile: what it raised, and the turns."""
    ticks = 0
    done = asyncio.ensure_future(job)
    while not done.done():
        await asyncio.sleep(0.01)
        ticks += 1
    return done.exception(), ticks


def test_a_huge_text_overruns_alone_and_the_loop_runs_on(tiny_model, codec):
    workers = TextWorkers(str(tiny_model), timeout=0.2, max_chars=100_000_000, workers=1,
                          queue_seconds=60)
    try:
        # One 8M-character word: byte-level BPE takes seconds over it, far past the bound.
        error, ticks = asyncio.run(_while_ticking(workers.encode("x" * 8_000_000)))
        assert isinstance(error, TextError) and error.status == 400 and "SHARD_TEXT_TIMEOUT" in str(error)
        assert ticks > 0  # the loop ran while the process worked
        workers.timeout = 60  # the fresh process serves the next job
        assert asyncio.run(workers.encode("after")) == codec.encode("after")
    finally:
        workers.close()


def test_a_template_that_loops_overruns_alone(tiny_model, tmp_path, codec):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}"
                               "{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    workers = TextWorkers(str(model), timeout=0.5, max_chars=100_000_000, workers=1,
                          queue_seconds=60)
    try:
        error, ticks = asyncio.run(_while_ticking(workers.encode_chat(CHAT)))
        assert isinstance(error, TextError) and error.status == 400  # overran, or a sandbox refused it
        assert ticks > 0
        workers.timeout = 60
        assert asyncio.run(workers.encode("after")) == codec.encode("after")
    finally:
        workers.close()
