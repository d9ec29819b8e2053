"""The placement picture (shard_contract.picture, shard_operator.planning.picture): well-formed SVG, every
rank drawn where the plan puts it with its numbers, dead ranks red, what is missing drawn to scale;
and the pictures in docs/ are what `shardctl plan` draws today."""

from __future__ import annotations

import shlex
from pathlib import Path
from xml.etree import ElementTree

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shard_contract.picture import DEAD, group_svg
from shard_contract.units import human
from shard_contract.wire import ShardEntry
from shard_operator.cli import main
from shard_operator.planning import PlanError, plan
from shard_operator.planning.inventory import parse_devices
from shard_operator.planning.picture import infeasible_svg, plan_svg
from tests.operator.conftest import make_plan, make_spec, tiny_profile
from tests.support.shards import measured

ROOT = Path(__file__).resolve().parents[3]
SVG = "{http://www.w3.org/2000/svg}"
# The commands docs/planner.md shows, and the pictures they drew (kept in docs/).
DOC_PICTURES = {
    "docs/plan-llama-8b.svg": 'shardctl plan -f examples/pipeline-explicit.yaml --model-dir examples/models/llama-3-8b '
                              '--devices "a:24GiB*2,b:16GiB*2@0.5" --svg docs/plan-llama-8b.svg',
    "docs/plan-llama-70b-infeasible.svg": 'shardctl plan -f examples/llama-70b.yaml --devices "a:80GiB*1,b:24GiB*2" '
                                          '--svg docs/plan-llama-70b-infeasible.svg',
}


def ranks(svg: str) -> dict[int, ElementTree.Element]:
    root = ElementTree.fromstring(svg)
    return {int(g.get("data-rank")): g for g in root.iter(SVG + "g") if g.get("class") == "rank"}


def texts(element: ElementTree.Element) -> dict[str, str]:
    return {t.get("class"): t.text for t in element.iter(SVG + "text") if t.get("class")}


@pytest.fixture
def tp2_pp2():
    return make_plan("a:24GiB*2,b:16GiB*2", parallelism={"tensor": 2, "pipeline": 2})


def test_every_rank_is_drawn_in_its_stage_column_with_the_plans_numbers(tp2_pp2):
    drawn = ranks(plan_svg(tp2_pp2))
    assert sorted(drawn) == [r.rank for r in tp2_pp2.ranks]
    for rp in tp2_pp2.ranks:
        g = drawn[rp.rank]
        assert (int(g.get("data-predicted")), int(g.get("data-capacity")), int(g.get("data-usable"))) == \
            (rp.predicted_bytes.total, rp.capacity_bytes, rp.usable_bytes)
        t = texts(g)
        assert t["where"] == f"{rp.node} · {rp.device}" and t["state"] == "planned"
        assert t["capacity"] == f"of {human(rp.capacity_bytes)}; usable {human(rp.usable_bytes)}"


def test_stages_go_left_to_right_and_tp_ranks_top_to_bottom(tp2_pp2):
    drawn = ranks(plan_svg(tp2_pp2))
    at = {r: (float(g.find(SVG + "rect").get("x")), float(g.find(SVG + "rect").get("y"))) for r, g in drawn.items()}
    # rank = stage * TP + tp_rank
    assert at[0][0] == at[1][0] < at[2][0] == at[3][0]
    assert at[0][1] == at[2][1] < at[1][1] == at[3][1]


@settings(max_examples=40, deadline=None)
@given(resident=st.integers(0, 2**40), alive=st.booleans(),
       state=st.sampled_from(["loading", "ready", "failed", "broken"]))
def test_a_live_rank_shows_its_measured_memory_and_is_red_exactly_when_dead(resident, alive, state):
    rp = make_plan().ranks[1]
    entry = ShardEntry(plan=rp, alive=alive, state=state, report=measured(resident))
    reason = f"rank {rp.rank} has sent no heartbeat for 6.0 s (dead or hung)"
    g = ranks(group_svg([entry], reason=reason))[rp.rank]
    dead = not alive or state in ("failed", "broken")
    box = g.find(SVG + "rect")
    assert (box.get("stroke") == DEAD) == dead and g.get("data-alive") == str(not dead).lower()
    assert texts(g)["memory"] == f"predicted {human(rp.predicted_bytes.total)} · resident {human(resident)}"
    note = texts(g).get("reason")
    assert (note is not None) == dead and (not dead or reason.startswith(note.rstrip("…")))
    banner = [t.text for t in ElementTree.fromstring(group_svg([entry], reason=reason)).iter(SVG + "text")
              if t.get("class") == "group-reason"]
    assert " ".join(banner) == (reason if dead else "")  # the whole reason above the group
    bars = [r for r in g.iter(SVG + "rect") if (r.findtext(SVG + "title") or "").startswith("measured")]
    assert len(bars) == 1 and float(bars[0].get("width")) <= 280  # never past the device's bar


def test_several_groups_are_stacked_in_one_document():
    two = make_plan(replicas=2)
    root = ElementTree.fromstring(plan_svg(two))
    nested = root.findall(SVG + "svg")
    assert len(nested) == 2 and float(nested[1].get("y")) == float(nested[0].get("height"))
    assert float(root.get("height")) == sum(float(n.get("height")) for n in nested)


def test_what_is_missing_is_drawn_to_scale():
    with pytest.raises(PlanError) as caught:
        plan(tiny_profile(), make_spec(replicas=3), parse_devices("a:1GiB*2"))
    err = caught.value
    short = err.shortfall
    assert short is not None and short.need > sum(short.usable)
    root = ElementTree.fromstring(infeasible_svg(err, "tiny does not fit"))
    rects = {cls: [r for r in root.iter(SVG + "rect") if r.get("class") == cls]
             for cls in ("need", "device", "missing")}
    width = {cls: sum(float(r.get("width")) for r in rs) for cls, rs in rects.items()}
    assert len(rects["device"]) == 2 and len(rects["missing"]) == 1
    assert width["missing"] / width["need"] == pytest.approx((short.need - sum(short.usable)) / short.need, abs=0.01)
    message = " ".join(t.text for t in root.iter(SVG + "text") if t.get("class") == "message")
    assert message.replace(" ", "") == err.message.replace("\n", "").replace(" ", "")


def test_a_plan_error_without_numbers_is_drawn_as_its_message():
    root = ElementTree.fromstring(infeasible_svg(PlanError("NoDevices", "no usable devices"), "m does not fit"))
    assert not [r for r in root.iter(SVG + "rect") if r.get("class")]
    assert [t.text for t in root.iter(SVG + "text") if t.get("class") == "message"] == ["no usable devices"]


@pytest.mark.parametrize("path", sorted(DOC_PICTURES))
def test_the_pictures_in_the_docs_are_what_the_command_draws(path, tmp_path, monkeypatch, capsys):
    command = DOC_PICTURES[path]
    assert command in (ROOT / "docs" / "planner.md").read_text(), f"docs/planner.md does not show {command}"
    argv = shlex.split(command)[1:]
    argv[argv.index("--svg") + 1] = str(tmp_path / "picture.svg")
    monkeypatch.chdir(ROOT)
    main(argv)
    assert (tmp_path / "picture.svg").read_text() == (ROOT / path).read_text(), \
        f"{path} is out of date: run `{command}`"
