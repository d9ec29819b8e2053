"""A sequence's text: the one detokenizer and the one stop-string cutter of the worker.

The engine deals in token ids only. The leader's HTTP side (and `shardctl generate`'s task on
the leader) turns each sequence's tokens into text here, step by step, and cuts it before the
first stop string; when one appears the engine is told to stop the sequence at its next step
boundary (`Hooks.stopped`), and answers it then. The ids answered end with the token that
completed the stop string.

Decoding is incremental, as vLLM's: each step decodes a window of the last few tokens, not the
whole sequence, so a step costs the same at token 10 and at token 10,000. Text that could still
change (an unfinished UTF-8 character, shown as U+FFFD) or turn out to be the start of a stop
string is held back until a later token settles it, so the deltas never need taking back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from shard_contract.wire import Completion, GenerateRequest

from ..log import first_line

if TYPE_CHECKING:
    from ..engine.sequences import SequenceState

Decode = Callable[[list[int]], str]


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that may still change or be cut: an unfinished UTF-8
    character (decoded as U+FFFD) or the start of a stop string."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold


def find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Where the first stop string begins in `text`, looking from `start` on; None if none does."""
    found = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(found) if found else None


class TextStream:
    """One sequence's tokens so far -> deltas of text and of ids; and its final answer.

    `step(tokens)` takes all the sequence's tokens so far (the engine's Step events carry them)
    and returns what is new and settled. Once a stop string appears, `stopped` is True, the text
    ends before it and the ids with the token that completed it; later tokens are ignored.
    """

    def __init__(self, decode: Decode | None, stops: list[str]):
        self.decode, self.stops = decode, [s for s in stops if s]
        self.ids: list[int] = []  # the tokens taken (up to the stop, once one is found)
        self.text = ""  # the text of `ids`, cut before a stop string
        self.stopped = False  # a stop string was met, or decoding failed (`error`): nothing more is read
        self.error: str | None = None
        self.stop_sent = False  # the engine has been told to stop the sequence
        self.sent_text, self.sent_ids = "", 0  # what `step` has handed out
        self._prefix = self._read = 0  # the decode window: ids[_prefix:_read] were read already

    def _take(self, token: int) -> None:
        self.ids.append(token)
        if self.decode is None:
            return
        before = self.decode(self.ids[self._prefix:self._read])
        now = self.decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return  # nothing settled yet (half a character): read it with the next token
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=1))
        self.text += now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        cut = find_stop(self.text, self.stops, start)
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True

    def step(self, tokens: list[int]) -> tuple[str, list[int]]:
        """The text and ids that `tokens` (all of them so far) add and that will not change."""
        self._read_tokens(tokens)
        ids, self.sent_ids = self.ids[self.sent_ids:], len(self.ids)
        safe = self.text if self.stopped else self.text[:len(self.text) - held_back(self.text, self.stops)]
        delta, self.sent_text = safe[len(self.sent_text):], safe
        return delta, ids

    def _read_tokens(self, tokens: list[int]) -> None:
        """Take the tokens not taken yet. A tokenizer that fails on them fails this sequence alone
        (`error`)."""
        for token in tokens[len(self.ids):]:
            if self.stopped:
                break
            try:
                self._take(token)
            except Exception as err:  # noqa: BLE001 -- tokenizers raises plain exceptions; this request's alone
                self.error, self.stopped = f"decoding its tokens failed: {first_line(err)}", True

    def finish(self, done: Completion) -> Completion:
        """The sequence's answer: `done` (the engine's, ids only) with its text, and, when a stop
        string was met, its ids up to it and the finish reason "stop"."""
        if done.finish_reason == "error":
            return done
        self._read_tokens(done.token_ids)
        kept = {"token_ids": self.ids} | {k: v[:len(self.ids)] for k in ("logprobs", "top_logprobs")
                                           if (v := getattr(done, k)) is not None}
        if self.decode is None:
            return done.model_copy(update=kept)
        # The whole sequence decoded once more: the one text a tokenizer gives for these ids
        # (an unfinished character at the very end included), cut before a stop string.
        try:
            whole = self.decode(self.ids) if self.error is None else ""
        except Exception as err:  # noqa: BLE001 -- as in `step`
            self.error = f"decoding its tokens failed: {first_line(err)}"
        if self.error is not None:
            return Completion(token_ids=self.ids, finish_reason="error", error=self.error)
        cut = find_stop(whole, self.stops)
        text = whole if cut is None else whole[:cut]
        reason = "stop" if self.stopped or cut is not None else done.finish_reason
        return done.model_copy(update={**kept, "text": text, "finish_reason": reason})

    def rest(self, final: Completion) -> tuple[str, list[int]]:
        """The last delta of a stream, given its `finish`ed completion: what was held back."""
        ids, self.sent_ids = final.token_ids[self.sent_ids:], len(final.token_ids)
        text = final.text or ""
        delta = text[len(self.sent_text):] if text.startswith(self.sent_text) else ""
        self.sent_text = text
        return delta, ids


class Texts:
    """The text side of a generate that runs on the engine thread (`shardctl generate`'s task,
    the tests): a TextStream per sequence, fed at each step (`step`, a `Hooks.step`); those whose
    text met a stop string are handed back by `stopped` (a `Hooks.stopped`), so the engine stops
    them at the next step boundary, as the server's."""

    def __init__(self, decode: Decode | None):
        self.decode = decode
        self.streams: dict[int, TextStream] = {}  # by sequence index
        self._stopping: list[int] = []

    def step(self, seqs: list[SequenceState]) -> None:
        for seq in seqs:
            stream = self.streams.setdefault(seq.index, TextStream(self.decode, seq.request.stop))
            if stream.stops and not stream.stopped:
                stream.step(seq.tokens)
                if stream.stopped:
                    self._stopping.append(seq.index)

    def stopped(self) -> list[int]:
        taken, self._stopping = self._stopping, []
        return taken

    def finish(self, requests: list[GenerateRequest], completions: list[Completion]) -> list[Completion]:
        """The answers, with their text: `completions[i]` is the engine's answer to `requests[i]`
        (in the order of arrival)."""
        return [self.streams.get(i, TextStream(self.decode, r.stop)).finish(c)
                for i, (r, c) in enumerate(zip(requests, completions, strict=True))]
