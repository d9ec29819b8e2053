"""`shardctl plan --html` in real headless Chromium: a plan that fits shows every rank with the plan's
numbers; one that does not shows what is missing."""

from __future__ import annotations

import json

import pytest

from shard_contract.units import human
from shard_operator.cli import EXIT_INFEASIBLE, main
from tests.serving.conftest import sharded_model_yaml

from .conftest import keep_screenshot


@pytest.fixture
def spec(tiny_model, tmp_path):
    return sharded_model_yaml(tmp_path / "tiny.yaml", tiny_model, tensor=2, pipeline=2)


def test_a_plan_that_fits_shows_every_rank_with_its_numbers(spec, tmp_path, browser, capsys):
    page = tmp_path / "plan.html"
    assert main(["plan", "-f", str(spec), "--devices", "localhost:160MiB*4", "--device-kind", "cpu", "--json",
                 "--html", str(page)]) == 0
    plan = json.loads(capsys.readouterr().out)
    browser.goto(page.as_uri())
    drawn = browser.evaluate("""[...document.querySelectorAll('g.rank')].map(g => ({...g.dataset,
        memory: g.querySelector('.memory').textContent, where: g.querySelector('.where').textContent}))""")
    assert len(drawn) == len(plan["ranks"]) == 4
    for rank, page_rank in zip(plan["ranks"], sorted(drawn, key=lambda d: int(d["rank"])), strict=False):
        p = rank["predicted_bytes"]
        assert (int(page_rank["rank"]), int(page_rank["stage"]), int(page_rank["tpRank"])) == \
            (rank["rank"], rank["stage"], rank["tp_rank"])
        assert (int(page_rank["predicted"]), int(page_rank["capacity"]), int(page_rank["usable"])) == \
            (p["total"], rank["capacity_bytes"], rank["usable_bytes"])
        assert page_rank["state"] == "planned" and page_rank["resident"] == ""
        share = p['total'] / rank['capacity_bytes']
        assert page_rank["memory"] == f"predicted {human(p['total'])}, {share:.0%} of the device"
        assert page_rank["where"] == f"{rank['node']} · {rank['device']}"
    text = browser.evaluate("document.getElementById('text').textContent")
    assert plan["hash"] in text and "critical path" in text  # the text table beside the picture
    browser.screenshot(tmp_path / "plan.png")


def test_a_plan_that_does_not_fit_shows_what_is_missing(spec, tmp_path, browser, capsys):
    page = tmp_path / "plan.html"
    assert main(["plan", "-f", str(spec), "--devices", "localhost:64MiB*4", "--device-kind", "cpu",
                 "--html", str(page)]) == EXIT_INFEASIBLE
    error = capsys.readouterr().err
    browser.goto(page.as_uri())
    assert browser.evaluate("document.querySelectorAll('g.rank').length") == 0
    assert browser.evaluate("document.querySelector('.reason').textContent") == "InsufficientCapacity"
    assert browser.evaluate("document.querySelectorAll('rect.need').length") == 3
    assert browser.evaluate("document.querySelectorAll('rect.device').length") == 4
    missing = browser.evaluate("document.querySelector('rect.missing title').textContent")
    assert missing.startswith("missing: ")
    # The bars are drawn to scale: the missing part is as long, for its bytes, as the pool's.
    widths = browser.evaluate("""(() => { const w = s => [...document.querySelectorAll(s)]
        .reduce((a, r) => a + parseFloat(r.getAttribute('width')), 0);
        return [w('rect.need'), w('rect.device'), w('rect.missing')]; })()""")
    assert widths[0] == pytest.approx(widths[1] + widths[2], abs=0.5)
    message = " ".join(browser.evaluate("[...document.querySelectorAll('.message')].map(t => t.textContent)"))
    assert "does not fit" in message and "To make it fit" in message
    assert error.startswith("shardctl: InsufficientCapacity: ")
    keep_screenshot(browser, tmp_path, "plan-infeasible.png")
