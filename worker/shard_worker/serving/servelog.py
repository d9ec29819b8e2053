"""What the leader logs of its serving, as vLLM does: a line for each request when it ends, and a
throughput line every 10 s while the engine works. Pure: the engine loop gives the numbers and
the time, and logs the lines (`log.py`)."""

from __future__ import annotations

from dataclasses import dataclass

THROUGHPUT_SECONDS = 10.0


def request_line(rid: str, prompt_tokens: int, generated: int, arrived: float, first_token: float | None,
                 now: float, finish: str) -> str:
    """One request's end: its id, tokens in and out, time to its first token and in all, and how
    it ended (stop, length, error, cancelled, rejected, failed)."""
    ttft = "-" if first_token is None else f"{first_token - arrived:.3f} s"
    return (f"request {rid}: prompt {prompt_tokens} tokens, generated {generated}, TTFT {ttft}, "
            f"total {now - arrived:.3f} s, finish {finish}")


@dataclass
class Throughput:
    """The tokens the engine took in (prompts, as they are prefilled) and gave out since the last
    throughput line. A window opens when work starts after a quiet spell, and its rates are over
    the time from then to the end of its latest step, so a burst is not averaged with the quiet
    around it."""

    period: float = THROUGHPUT_SECONDS
    start: float | None = None  # when the window's work began; None while there has been none
    last: float = 0.0  # when its latest step ended
    prompt: int = 0
    generated: int = 0

    def busy(self, now: float) -> None:
        """Work starts (a batch)."""
        if self.start is None:
            self.start = now

    def step(self, now: float, prompt: int, generated: int) -> None:
        """A step ended at `now`, having prefilled `prompt` tokens and generated `generated`."""
        self.busy(now)
        self.prompt, self.generated, self.last = self.prompt + prompt, self.generated + generated, now

    def line(self, now: float, running: int, waiting: int, rows: int, kv_used: int, kv_capacity: int) -> str | None:
        """The throughput line, once a period has passed since the window opened (else None); it
        closes the window, and opens the next one while requests remain."""
        if self.start is None or now - self.start < self.period:
            return None
        seconds = self.last - self.start

        def rate(tokens: int) -> float:
            return tokens / seconds if seconds > 0 else 0.0

        text = (f"throughput: prompt {rate(self.prompt):.1f} tokens/s, generation {rate(self.generated):.1f} "
                f"tokens/s; running {running} of {rows} rows, waiting {waiting}; KV cache {kv_used} of "
                f"{kv_capacity} tokens ({kv_used / kv_capacity:.1%})")
        self.start = now if running or waiting else None
        self.prompt = self.generated = 0
        return text
