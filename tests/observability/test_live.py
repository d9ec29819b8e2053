"""A live TP=2 x PP=2 group seen three ways: its `/dashboard` in real headless Chromium, a real
Prometheus scraping it (and the real operator's metrics) that evaluates every query of the chart's
Grafana dashboard and every alerting rule, and the dashboard again once a rank is killed."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading

import httpx
import pytest
import yaml

from shard_contract.plan import describe_layers
from shard_contract.sharding import KV_BLOCK_SIZE
from shard_contract.units import human
from shard_operator import metrics
from shard_operator.local.launcher import free_port
from tests.operator.integration.conftest import world  # noqa: F401 -- the emulated cluster the operator runs against
from tests.packaging.chart import MONITORING_API, one, render
from tests.packaging.test_dashboard import LABEL_VALUES, dashboard, panels
from tests.support.cluster import gpu_node, sharded_model, write_model
from tests.support.prometheus import Prometheus

from .conftest import MODEL, keep_screenshot

pytestmark = pytest.mark.slow

HEALTH_DEADLINE = 10.0  # seconds: /health fails within it (tests/serving/test_failures.py)
POLL = 2.0  # the page's period
RELEASE_JOB = "shard-system/so-shard-operator"  # the ServiceMonitor's job for release "so" (tests/packaging/chart.py)
WORKERS_JOB = RELEASE_JOB + "-workers"  # the PodMonitor's
GRAFANA = {"$namespace": "default", "$model": MODEL, "$__rate_interval": "20s"}


def ranks_in_page(browser) -> list[dict]:
    return browser.evaluate("""[...document.querySelectorAll('#layout g.rank')].map(g => ({
        ...g.dataset, rank: +g.dataset.rank,
        where: g.querySelector('.where').textContent, memory: g.querySelector('.memory').textContent,
        capacityText: g.querySelector('.capacity').textContent,
        stroke: g.querySelector('rect').getAttribute('stroke'),
        reason: (g.querySelector('.reason') || {}).textContent || '',
        row: [...document.querySelectorAll(`#ranks tr[data-rank="${g.dataset.rank}"] td`)].map(td => td.textContent),
    }))""")


# A prompt of several full KV blocks (16 tokens each) that every other request of the prefix
# traffic starts with: its blocks are looked up, and found once one request has computed them.
SHARED_PROMPT = "Every request of this traffic starts with the same long story: " + "once upon a time, " * 12


class Traffic(threading.Thread):
    """Completions one after another until stopped; with `shared_prefix`, every other one starts
    with SHARED_PROMPT (and ends with its own number)."""

    def __init__(self, group, shared_prefix: bool = False):
        super().__init__(daemon=True)
        self.group, self.shared_prefix, self.done, self.stop = group, shared_prefix, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.shared_prefix and self.done % 2:
                self.group.complete_prompt(f"{SHARED_PROMPT} {self.done}")
            else:
                self.group.complete(1)
            self.done += 1

    def __enter__(self) -> Traffic:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.join(120)


# ---------------------------------------------------------------- the page
def test_the_dashboard_shows_every_rank_as_v1_shards_does(group, browser, tmp_path):
    with Traffic(group) as traffic:
        browser.goto(group.url + "/dashboard")
        browser.wait_for("document.querySelectorAll('#layout g.rank').length === 4", timeout=20)
        # Rates need two polls with work between them: tokens/s and every rank's shares appear.
        browser.wait_for("parseFloat(document.querySelector('#chart-tokens .now').textContent) > 0", timeout=30)
        browser.wait_for("[...document.querySelectorAll('#ranks tbody tr')]"
                         ".every(tr => tr.cells[6].textContent.endsWith('%'))",
                         timeout=30)
        browser.wait_for("parseFloat(document.querySelector('#chart-latency .now').textContent) > 0", timeout=30)
    assert traffic.done > 0
    shards = group.shards()
    assert shards["ready"] and browser.evaluate("document.getElementById('status').textContent") == "ready"
    assert not browser.evaluate("document.getElementById('banner').offsetParent")  # no health banner
    drawn = {r["rank"]: r for r in ranks_in_page(browser)}
    assert sorted(drawn) == [0, 1, 2, 3]
    for shard in shards["ranks"]:
        entry = shard["plan"]  # where it runs and what the plan predicted
        page = drawn[entry["rank"]]
        predicted, resident = entry["predicted_bytes"]["total"], shard["report"]["resident_bytes"]["total"]
        assert (page["stage"], page["tpRank"], page["alive"], page["state"]) == \
            (str(entry["stage"]), str(entry["tp_rank"]), "true", "ready")
        assert (int(page["predicted"]), int(page["resident"])) == (predicted, resident)
        assert (int(page["capacity"]), int(page["usable"])) == (entry["capacity_bytes"], entry["usable_bytes"])
        assert page["where"] == f"{entry['node']} · {entry['device']}"
        assert page["memory"] == f"predicted {human(predicted)} · resident {human(resident)}"
        assert page["capacityText"] == f"of {human(entry['capacity_bytes'])}; usable {human(entry['usable_bytes'])}"
        assert page["row"][:5] == [str(entry["rank"]), str(entry["stage"]), str(entry["tp_rank"]),
                                   f"{entry['node']} · {entry['device']}", "ready"]
        shares = [float(cell.rstrip("%")) for cell in page["row"][6:9]]
        assert 98 <= sum(shares) <= 102 and shares[1] > 0, page["row"]  # every rank communicates in TP=2
        # bytes/s of the operations that ran in the page's window (which ones depends on the moment)
        assert re.fullmatch(r"(\w+ [\d.]+ (B|KiB|MiB|GiB)/s(, )?)+", page["row"][9]), page["row"][9]
    stages = browser.evaluate("[...document.querySelectorAll('#stages tbody tr')].map(tr => tr.cells[1].textContent)")
    assert stages == [describe_layers(s["plan"]["layers"]) for s in shards["ranks"] if s["plan"]["tp_rank"] == 0]
    keep_screenshot(browser, tmp_path, "dashboard.png")


def test_the_dashboard_is_served_by_the_leader_alone(group):
    page = httpx.get(group.url + "/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text), "the page fetches from elsewhere"
    svg = httpx.get(group.url + "/dashboard/layout.svg", timeout=10)
    assert svg.headers["content-type"].startswith("image/svg+xml") and svg.text.count('class="rank"') == 4
    other = group.launcher.ranks[1].port
    assert httpx.get(f"http://127.0.0.1:{other}/dashboard", timeout=10).status_code == 404


# ---------------------------------------------------------------- Prometheus
def grafana_queries() -> list[tuple[str, str, set[str]]]:
    """(panel title, PromQL with the dashboard's variables filled in, labels its legend names)."""
    found = []
    for panel in panels(dashboard()):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA.items():
                expr = expr.replace(variable, value)
            found.append((panel["title"], expr, set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"]))))
    return found


def panel_values(prom: Prometheus, title: str) -> list[float]:
    """The latest value of each target's series of the dashboard panel `title`, in target order
    (series of one target in label order); a target with no series gives none."""
    values = []
    for found, expr, _ in grafana_queries():
        if found == title:
            series = sorted(prom.query(expr), key=lambda s: sorted(s["metric"].items()))
            values += [float(s["value"][1]) for s in series]
    assert values, f"no panel {title!r} with data"
    return values


def scrape_configs(group, operator_port: int) -> list[dict]:
    """What the chart's PodMonitor and ServiceMonitor make Prometheus scrape, written out: every rank
    with its namespace and pod labels, and the operator with its own labels honoured."""
    ranks = [{"targets": [f"127.0.0.1:{r.port}"], "labels": {"namespace": "default", "container": "worker",
                                                              "pod": f"{MODEL}-0-abc-{r.rank}"}}
             for r in group.launcher.ranks]
    return [{"job_name": WORKERS_JOB, "static_configs": ranks},
            {"job_name": RELEASE_JOB, "honor_labels": True,
             "static_configs": [{"targets": [f"127.0.0.1:{operator_port}"]}]}]


def evaluate_everything(group, operator_port: int, tmp_path) -> None:
    rules = tmp_path / "rules.yaml"
    rule = one(render(sets=["metrics.prometheusRule.enabled=true", "metrics.podMonitor.enabled=true"],
                      api_versions=MONITORING_API), "PrometheusRule")
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    with Prometheus(scrape_configs(group, operator_port), [rules]) as prom:
        prom.wait(lambda: len(prom.targets_up()) == 5 and set(prom.targets_up().values()) == {"up"}, 60,
                  "scraping every target")
        def answering() -> bool:
            tokens = prom.query(f'sum(rate(shard_tokens_generated_total{{model="{MODEL}"}}[20s]))')
            return bool(tokens) and float(tokens[0]["value"][1]) > 0 and \
                all(prom.query(expr) for _, expr, _ in grafana_queries())

        with Traffic(group, shared_prefix=True) as traffic:  # requests run until every query has answered
            prom.wait(lambda: traffic.done > 0 and answering(), 180, "answering every dashboard query, tokens flowing")
            for title, expr, legend in grafana_queries():
                series = prom.query(expr)
                assert series, f"{title}: {expr} returned nothing"
                for s in series:
                    assert legend <= set(s["metric"]), f"{title}: {expr} lacks {legend - set(s['metric'])}: {s}"
            # The scheduling panels' values against what the group is: the shared prompt's blocks
            # are found in the prefix cache (a hit rate above 0), and the blocks used and free add
            # up to what the leader's paged cache gives sequences, which is the plan's capacity.
            prom.wait(lambda: panel_values(prom, "Prefix cache hit rate")[0] > 0
                      and panel_values(prom, "Prefix cache lookups and hits")[1] > 0, 120, "prefix cache hits")
            shards = group.shards()
            capacity = shards["kv_cache_tokens"]  # the leader's pool, as loaded
            assert capacity == shards["ranks"][0]["plan"]["kv_cache_tokens"] > 0
            assert sum(panel_values(prom, "KV cache blocks used / free")) * KV_BLOCK_SIZE == capacity
            assert panel_values(prom, "KV cache tokens: capacity and in use")[0] == capacity
        # A few of the values, against what the group is.
        assert float(prom.query(f'sum(shard_group_ready{{model="{MODEL}"}})')[0]["value"][1]) == 4
        assert len(prom.query('shard_resident_bytes{kind="total"}')) == 4
        assert not prom.query('{__name__=~".+_created"}')  # neither the ranks nor the operator expose them
        assert prom.query(f'shard_operator_replicas{{namespace="default", model="{MODEL}"}}')[0]["value"][1] == "1"
        for var in dashboard()["templating"]["list"][1:]:  # label_values(selector, label)
            match = LABEL_VALUES.match(var["query"]["query"].replace("$namespace", GRAFANA["$namespace"]))
            values = prom.api(f"label/{match['label']}/values", **{"match[]": match["selector"]})
            assert GRAFANA["$" + match["label"]] in values, f"variable {var['name']}: {values}"
        # The alerting rules load and evaluate against these series without error. Nothing is down,
        # over its plan, failing or out of restarts; gloo on two shared cores does spend about half
        # of its busy time communicating, so that alert may be pending (tests/packaging/test_alerts.py
        # checks each alert's thresholds).
        prom.wait(lambda: all(r.get("lastEvaluation", "").startswith("2") and r["health"] == "ok"
                              for g in prom.api("rules")["groups"] for r in g["rules"]), 30, "evaluating the rules")
        states = {r["name"]: r["state"] for g in prom.api("rules")["groups"] for r in g["rules"]}
        assert states.pop("ShardCommunicationShareHigh") in ("inactive", "pending")
        assert states == dict.fromkeys(["ShardRankDown", "ShardResidentAbovePlan", "ShardRequestsFailing",
                                        "ShardRestartBudgetExhausted", "ShardRankFailedForGood"], "inactive"), states


async def test_prometheus_evaluates_every_grafana_query_and_alert_rule(group, world, tmp_path):  # noqa: F811 -- the fixture above
    await world.add_node(gpu_node("a"))
    model_dir = write_model(world.tmp / "models" / MODEL)
    async with world.operator() as op:
        await world.create(sharded_model(MODEL, model_dir))
        await world.wait_phase(MODEL, "Ready")
        port = free_port()
        server = metrics.serve(op, port, addr="127.0.0.1")
        try:
            await asyncio.to_thread(evaluate_everything, group, port, tmp_path)
        finally:
            server.shutdown()
            server.server_close()


# ---------------------------------------------------------------- a rank dies (last: it breaks the group)
def test_a_killed_rank_turns_red_with_the_reason_health_gives(group, browser, tmp_path):
    browser.goto(group.url + "/dashboard")
    browser.wait_for("document.querySelectorAll('#layout g.rank[data-alive=\"true\"]').length === 4", timeout=20)
    victim = group.launcher.ranks[3]
    os.kill(victim.process.pid, signal.SIGKILL)
    # /health's promise plus one poll of the page
    browser.wait_for("document.querySelector('#layout g.rank[data-rank=\"3\"]').dataset.alive === 'false'",
                     timeout=HEALTH_DEADLINE + POLL)
    browser.wait_for("document.getElementById('banner').offsetParent !== null", timeout=POLL + 1)
    health = httpx.get(group.url + "/health", timeout=10)
    assert health.status_code == 503
    reason = health.json()["reason"]
    assert reason.startswith("rank 3 has sent no heartbeat")
    banner = browser.evaluate("document.getElementById('banner').textContent")
    assert banner.startswith("/health: rank 3 has sent no heartbeat"), banner
    drawn = {r["rank"]: r for r in ranks_in_page(browser)}
    assert drawn[3]["stroke"] == "#d62728" and drawn[3]["state"] == "dead"
    assert drawn[3]["reason"].startswith("rank 3 has sent no heartbeat")
    assert {r: drawn[r]["alive"] for r in (0, 1, 2)} == {0: "true", 1: "true", 2: "true"}
    assert browser.evaluate("document.querySelector('#ranks tr[data-rank=\"3\"]').className") == "dead"
    assert browser.evaluate("document.getElementById('status').textContent") == "unhealthy"
    keep_screenshot(browser, tmp_path, "dashboard-dead-rank.png")
