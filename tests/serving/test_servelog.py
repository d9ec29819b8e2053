"""The leader's log of its serving (`servelog.py`): a line per request, and throughput lines whose
rates cover the work of their window, not the quiet around it."""

from __future__ import annotations

from shard_worker.serving.servelog import Throughput, request_line


def test_a_request_line_names_the_request_its_tokens_its_times_and_how_it_ended():
    assert request_line("cmpl-1", 12, 24, arrived=100.0, first_token=100.125, now=101.5, finish="length") == \
        "request cmpl-1: prompt 12 tokens, generated 24, TTFT 0.125 s, total 1.500 s, finish length"
    assert request_line("cmpl-2", 7, 0, arrived=5.0, first_token=None, now=5.25, finish="cancelled") == \
        "request cmpl-2: prompt 7 tokens, generated 0, TTFT -, total 0.250 s, finish cancelled"


def line(t: Throughput, now: float, running: int = 1, waiting: int = 0) -> str | None:
    return t.line(now, running, waiting, rows=4, kv_used=20, kv_capacity=256)


def test_throughput_lines_come_every_period_while_busy_with_rates_over_the_work():
    t = Throughput(period=10)
    assert line(t, 0.0, running=0) is None and line(t, 1000.0, running=0) is None  # nothing has happened
    t.busy(2000.0)  # a batch starts
    t.step(2001.0, prompt=10, generated=4)
    t.step(2004.0, prompt=0, generated=4)
    assert line(t, 2005.0) is None  # not a period yet
    assert line(t, 2010.5) == ("throughput: prompt 2.5 tokens/s, generation 2.0 tokens/s; running 1 of 4 rows, "
                               "waiting 0; KV cache 20 of 256 tokens (7.8%)")
    # still running: the next window opens at once
    t.step(2012.0, prompt=0, generated=3)
    assert line(t, 2015.0, running=0) is None
    # the batch ended at 2012: the rates cover 2010.5-2012, not the quiet after it
    assert line(t, 2030.0, running=0).startswith("throughput: prompt 0.0 tokens/s, generation 2.0 tokens/s; "
                                                  "running 0 of 4 rows")
    assert line(t, 5000.0, running=0) is None  # quiet: nothing more to say
    t.busy(6000.0)  # after a quiet spell, the window opens with the work
    t.step(6001.0, prompt=0, generated=5)
    assert line(t, 6010.0).startswith("throughput: prompt 0.0 tokens/s, generation 5.0 tokens/s")


def test_a_window_without_a_finished_step_reports_zero_rates():
    t = Throughput(period=10)
    t.busy(0.0)  # a prefill longer than the period
    assert line(t, 11.0).startswith("throughput: prompt 0.0 tokens/s, generation 0.0 tokens/s")
