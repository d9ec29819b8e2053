"""The leader's tokenizing and chat-template rendering, in child processes of their own.

Both can take long on hostile input (tokenizing grows faster than linearly with the text; a
template is a program), and both hold a Python thread's GIL for their whole run when done in
process: the engine thread, which shares the GIL, would wait, and so would the event loop that
answers `/health`. So the leader hands each request's text to one of a few child processes
(`python -m shard_worker.serving.textproc MODEL_DIR`, which import neither torch nor the server) and waits
for the token ids off its event loop. A child that runs past the request's time bound
(SHARD_TEXT_TIMEOUT) is killed and replaced: that request fails alone, and the others go on.

The children hold the model's tokenizer each (a few MB to a few hundred MB for a large vocabulary)
outside the rank's own resident bytes. A child dies with its leader (PR_SET_PDEATHSIG, and the end
of its input).

Frames on the pipes: a 4-byte big-endian length, then the payload. A job is JSON
({"text": ...} or {"messages": [...]}, with "max_chars"); a reply is one status byte, then the
token ids as little-endian int32 (OK), or a UTF-8 message.
"""

from __future__ import annotations

import array
import asyncio
import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

OK, REFUSED, FAILED = 0, 1, 2  # reply statuses: the ids; a refusal of the input (400); a failure (500)
WORKERS = 2
START_SECONDS = 120.0  # a child's own start (loading a large tokenizer), apart from any request's bound


class TextError(Exception):
    """A request's text could not be made into token ids: `status` 400 (the input or the template
    refused it, or it took longer than its bound), 500 (the child failed) or 503 (every child
    stayed busy for the whole bound)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


# ---------------------------------------------------------------- the parent's side
class _Child:
    """One child process and its pipes; used by one request at a time."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.proc = subprocess.Popen([sys.executable, "-m", "shard_worker.serving.textproc", model_dir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.started = False

    def _read(self, n: int, deadline: float) -> bytes:
        assert self.proc.stdout is not None
        fd, data = self.proc.stdout.fileno(), b""
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def call(self, job: bytes, seconds: float) -> tuple[int, bytes]:
        """Send one job and wait for its reply at most `seconds` (after the child's own start)."""
        if not self.started:  # the child says it has loaded the tokenizer with one byte
            self._read(1, time.monotonic() + START_SECONDS)
            self.started = True
        assert self.proc.stdin is not None
        deadline = time.monotonic() + seconds
        self.proc.stdin.write(_frame(job))
        (size,) = struct.unpack(">I", self._read(4, deadline))
        reply = self._read(size, deadline)
        return reply[0], reply[1:]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class TextWorkers:
    """A few children that turn text into token ids; `encode` and `encode_chat` run on the event
    loop and wait for a child off it (on a thread of their own per child)."""

    def __init__(self, model_dir: str, timeout: float, max_chars: int, workers: int = WORKERS,
                 queue_seconds: float | None = None):
        """`timeout`: a job's bound, once a child has it; `queue_seconds` (default: the same): how
        long a job may wait for a child before it is refused."""
        self.model_dir, self.timeout, self.max_chars = model_dir, timeout, max_chars
        self.queue_seconds = timeout if queue_seconds is None else queue_seconds
        self.idle: list[_Child] = [_Child(model_dir) for _ in range(workers)]
        self.lock = threading.Lock()
        self.threads = ThreadPoolExecutor(workers, thread_name_prefix="text")  # one a child: one is always idle

    async def encode(self, text: str) -> list[int]:
        """Token ids of a prompt's text, with the special tokens the tokenizer adds (a BOS)."""
        return await self._run({"text": text})

    async def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (offering `tools`)."""
        return await self._run({"messages": messages, "tools": tools})

    async def _run(self, job: dict[str, Any]) -> list[int]:
        job["max_chars"] = self.max_chars
        payload = json.dumps(job).encode()
        status, payload = await asyncio.get_running_loop().run_in_executor(
            self.threads, self._call, payload, time.monotonic())
        if status == OK:
            ids = array.array("i")
            ids.frombytes(payload)
            if sys.byteorder != "little":
                ids.byteswap()
            return ids.tolist()
        raise TextError(400 if status == REFUSED else 500, payload.decode(errors="replace"))

    def _call(self, job: bytes, queued: float) -> tuple[int, bytes]:
        """On a thread of ours: take an idle child, run the job, give it back (or a fresh one in
        its place when it overran or died). A job that waited its whole bound is not run."""
        if time.monotonic() - queued > self.queue_seconds:
            raise TextError(503, f"the tokenizer processes stayed busy for {self.queue_seconds:g} s")
        with self.lock:
            child = self.idle.pop()
        try:
            return child.call(job, self.timeout)
        except TimeoutError:
            child.kill()
            child = _Child(self.model_dir)
            raise TextError(400, f"tokenizing took longer than this server's bound of {self.timeout:g} s "
                                 "(SHARD_TEXT_TIMEOUT)") from None
        except (EOFError, OSError) as err:
            child.kill()
            child = _Child(self.model_dir)
            raise TextError(500, f"the tokenizer process failed: {type(err).__name__}") from None
        finally:
            with self.lock:
                self.idle.append(child)

    def close(self) -> None:
        with self.lock:
            for child in self.idle:
                child.kill()


# ---------------------------------------------------------------- the child
def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (it may be busy, not reading)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the end of the input still ends it, once idle
        pass


def _work(codec: Any, job: dict[str, Any]) -> tuple[int, bytes]:
    from ..log import first_line
    from .tokenizer import TemplateError

    max_chars = int(job["max_chars"])
    try:
        if "messages" in job:
            text = codec.render_chat(job["messages"], job.get("tools"))
            special = False  # the template writes the special tokens itself (a BOS among them)
        else:
            text, special = job["text"], True
        if len(text) > max_chars:
            what = "the rendered conversation" if "messages" in job else "the text"
            return REFUSED, (f"{what} has {len(text)} characters; no prompt of more than {max_chars} characters "
                             "fits this model's context").encode()
        ids = codec.encode(text, add_special_tokens=special)
    except TemplateError as err:
        return REFUSED, str(err).encode()
    except Exception as err:  # noqa: BLE001 -- tokenizers raises plain exceptions on text it cannot take
        return REFUSED, f"the tokenizer cannot encode it: {first_line(err)}".encode()
    out = array.array("i", ids)
    if sys.byteorder != "little":
        out.byteswap()
    return OK, out.tobytes()


def main(model_dir: str) -> int:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the leader's to handle
    from .tokenizer import TextCodec

    codec = TextCodec.load(model_dir)
    if codec is None:
        return 1
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(b"\x01")
    stdout.flush()
    while True:
        try:
            (size,) = struct.unpack(">I", _read_exact(stdin, 4))
            job = json.loads(_read_exact(stdin, size))
        except EOFError:
            return 0
        status, payload = _work(codec, job)
        stdout.write(_frame(bytes([status]) + payload))
        stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
