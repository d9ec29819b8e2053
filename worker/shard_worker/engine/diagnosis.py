"""What a rank says about the work it held when its engine raised: the requests in its batch's rows,
so that an input that takes a group down can be found in the dying rank's own log (a follower
that dies leaves the leader with no more than "Connection closed by peer"). Pure functions of
the engine's state; `Engine` adds their text to the exception as a note, which the traceback
the rank logs prints."""

from __future__ import annotations

from shard_contract.wire import GenerateRequest

from ..model.paging import RESERVED_BLOCKS
from .sequences import PARKED, Rows

PROMPT_HEAD = 16  # prompt tokens quoted (a prompt may be as long as the context)
TEXT_LIMIT = 200  # characters of a JSON schema or a stop string quoted


def _clip(text: str) -> str:
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + f"...({len(text)} chars)"


def request_summary(request: GenerateRequest) -> str:
    """A request as a log line: every field that differs from its default (the prompt as its
    length and first tokens), so the request can be sent again."""
    fields = request.model_dump(exclude_defaults=True, exclude={"prompt_ids"})
    prompt = request.prompt_ids
    head = prompt[:PROMPT_HEAD]
    parts = [f"prompt_ids={head}{'...' if len(prompt) > PROMPT_HEAD else ''} ({len(prompt)} tokens)"]
    for name, value in fields.items():
        parts.append(f"{name}={_clip(value) if isinstance(value, str) else _clip(repr(value))}")
    return ", ".join(parts)


def rows_summary(rows: Rows) -> str:
    """Every row that has held a request in this generate: its padding (or PARKED), its block
    table's held blocks, its first own position, and its request."""
    lines = []
    for row, request in enumerate(rows.requests):
        if request is None:
            continue
        pad = int(rows.pads[row])
        held = [int(b) for b in rows.tables[row].tolist() if b >= RESERVED_BLOCKS]  # not ZERO, TRASH
        lines.append(f"  row {row}: pad {'PARKED' if pad >= PARKED else pad}, blocks {held}, start "
                     f"{int(rows.starts[row])}: {request_summary(request)}")
    return "\n".join(lines) if lines else "  (no row holds a request)"
