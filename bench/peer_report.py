"""bench/serve_peer.py's arithmetic and tables, pure: what each phase measured from its requests
(every request counted, a failed one with its reason), issue 28's goals as ratios, and the text
of the report. No I/O, so tests/bench/test_peer_report.py checks it on made-up results.

A request is a dict from `peer_client.stream`: start, end, events [(time, tokens)], tokens,
ttft (None without tokens), error (None, or why it failed). A phase that could not be measured
(the budget, a server that did not start, an exception) is {"not_measured": reason}.
"""

from __future__ import annotations

import itertools
import json
import math

OURS, PEER = "shard-operator", "llama-server"
SERVERS = (OURS, PEER)
# issue 28's goals: ratio targets
GOALS = {"tokens_per_s": 1.0, "long_gap": 2.0, "prefix_ttft": 3.0, "kv_of_free": 0.9}
ERRORS_KEPT = 3  # distinct reasons a phase keeps, with their counts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


def gaps(result: dict) -> list[tuple[float, float]]:
    """(time of a chunk, time of the next) for each pair of a stream's successive chunks."""
    return list(itertools.pairwise(t for t, _ in result["events"]))


def failures(results: list[dict]) -> dict:
    """How many requests failed, and the most common reasons (counted)."""
    reasons: dict[str, int] = {}
    for r in results:
        if r["error"]:
            reasons[r["error"]] = reasons.get(r["error"], 0) + 1
    common = sorted(reasons.items(), key=lambda kv: -kv[1])[:ERRORS_KEPT]
    return {"failed": sum(reasons.values()), "errors": [f"{n}x {why}" for why, n in common]}


def throughput_row(clients: int, results: list[dict], load: float) -> dict:
    """One client count: tokens/s of the completed requests over the whole phase (first start to
    last end, failed requests included in the span), TTFT and ITL of the completed ones."""
    done = [r for r in results if not r["error"]]
    row = {"clients": clients, "requests": len(results), **failures(results), "load": load}
    if not done:
        return {**row, "not_measured": f"all {len(results)} requests failed"}
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    itl = [b - a for r in done for a, b in gaps(r)]
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    return {**row, "tokens_per_s": sum(r["tokens"] for r in done) / span,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "itl_p50": percentile(itl, 0.5), "itl_p99": percentile(itl, 0.99)}


def long_summary(shorts: list[dict], long: dict | None) -> dict:
    """The short streams' longest inter-token gap. Alone (`long` None): over their steady part,
    once every one has its first token. Joined: over the gaps that overlap the long request's
    life (sent to its last token), the time it joins them; `through_join` counts the short
    streams still running at its first token (fewer than all: the join was only partly seen)."""
    out = {"shorts": len(shorts), **failures(shorts + ([long] if long else []))}
    ok = [r for r in shorts if not r["error"] and r["events"]]
    if len(ok) < len(shorts):
        return {**out, "not_measured": f"{len(shorts) - len(ok)} of {len(shorts)} short streams failed"}
    if long is None:
        steady = max(r["events"][0][0] for r in ok)
        pairs = [(a, b) for r in ok for a, b in gaps(r) if a >= steady]
        return {**out, "worst_gap": max((b - a for a, b in pairs), default=math.nan), "gaps": len(pairs)}
    if long["error"] or long["ttft"] is None:
        return {**out, "not_measured": f"the long request failed: {long['error']}"}
    first = long["start"] + long["ttft"]
    pairs = [(a, b) for r in ok for a, b in gaps(r) if b > long["start"] and a < long["end"]]
    return {**out, "worst_gap": max((b - a for a, b in pairs), default=math.nan), "gaps": len(pairs),
            "long_ttft": long["ttft"], "through_join": sum(1 for r in ok if r["events"][-1][0] >= first)}


def prefix_summary(results: list[dict]) -> dict:
    """Mean TTFT of the completed requests of a shared-prefix run."""
    ttft = [r["ttft"] for r in results if not r["error"] and r["ttft"] is not None]
    out = {"requests": len(results), **failures(results)}
    if not ttft:
        return {**out, "not_measured": "no request completed"}
    return {**out, "mean_ttft": sum(ttft) / len(ttft)}


def overflow_summary(results: list[dict], new_tokens: int) -> dict:
    """Answered: every token asked for; short: ended without an error but with fewer."""
    f = failures(results)
    answered = sum(1 for r in results if not r["error"] and r["tokens"] == new_tokens)
    return {"requests": len(results), "answered": answered, "short": len(results) - answered - f["failed"], **f}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else None


def why_not(name: str, phase: dict | None) -> str | None:
    """Why `name`'s phase has no value: None when it has one."""
    if phase is None:
        return f"{name}: not run"
    if "not_measured" in phase:
        return f"{name}: failed ({phase['not_measured']})"
    return None


def failed_note(name: str, phase: dict | None) -> str:
    return f"{name}: {phase['failed']} of {phase.get('requests', '?')} requests failed" \
        if phase and phase.get("failed") else ""


def server_failure(out: dict) -> dict | None:
    """A server that failed as a whole stands for each of its phases."""
    return {"not_measured": out["not_measured"]} if "not_measured" in out else None


def goal_row(what: str, value: float | None, target: str, met: bool | None, notes: list[str | None]) -> dict:
    return {"goal": what, "value": value, "target": target, "met": met, "note": "; ".join(n for n in notes if n)}


def tokens_goals(ours: dict, peer: dict) -> list[dict]:
    """tokens/s ours / llama-server per client count, matched by count (a side missing: failed)."""
    by = [{r["clients"]: r for r in out.get("throughput", [])} for out in (ours, peer)]
    rows = []
    for clients in sorted(set(by[0]) | set(by[1])):
        a, b = (phases.get(clients, server_failure(out)) for phases, out in zip(by, (ours, peer), strict=True))
        missing = [why_not(OURS, a), why_not(PEER, b)]
        value = None if a is None or b is None or any(missing) else ratio(a["tokens_per_s"], b["tokens_per_s"])
        rows.append(goal_row(f"tokens/s ours / llama-server, {clients} clients", value, ">= 1",
                             None if value is None else value >= GOALS["tokens_per_s"],
                             [*missing, failed_note(OURS, a), failed_note(PEER, b)]))
    return rows


def long_goal(name: str, alone: dict | None, joined: dict | None) -> dict:
    missing = [why_not("alone", alone), why_not("joined", joined)]
    value, notes = None, list(missing)
    if alone is not None and joined is not None and not any(missing):
        value = ratio(joined["worst_gap"], alone["worst_gap"])
        if joined["through_join"] < joined["shorts"]:
            notes.append(f"only {joined['through_join']} of {joined['shorts']} short streams ran until the long "
                         "prompt's first token")
    return goal_row(f"{name}: short streams' longest gap, long prompt joining / alone", value, "<= 2",
                    None if value is None else value <= GOALS["long_gap"], notes)


def prefix_goal(name: str, cached: dict | None, uncached: dict | None) -> dict:
    missing = [why_not("cached", cached), why_not("uncached", uncached)]
    value = None
    if cached is not None and uncached is not None and not any(missing):
        value = ratio(uncached["mean_ttft"], cached["mean_ttft"])
    return goal_row(f"{name}: 1k shared prefix TTFT, uncached / cached", value, ">= 3",
                    None if value is None else value >= GOALS["prefix_ttft"],
                    [*missing, failed_note("cached", cached), failed_note("uncached", uncached)])


def overflow_goal(name: str, over: dict | None) -> dict:
    """All answered (target), with the failures, short answers and our preemptions as notes: no
    preemption means the cache never overflowed, so the scenario was not what it claims."""
    missing = why_not("overflow", over)
    value, notes = None, [missing]
    if over is not None and not missing:
        value = ratio(over["answered"], over["requests"])
        notes += [f"{over['failed']} failed: {', '.join(over['errors'])}" if over["failed"] else None,
                  f"{over['short']} ended short" if over["short"] else None]
        if over.get("preemptions") is not None:
            notes.append(f"{over['preemptions']:.0f} preemptions"
                         + ("" if over["preemptions"] else " (the cache never overflowed: not the scenario)"))
        if over.get("kv_tokens"):
            notes.append(f"KV cache {over['kv_tokens']} tokens for {over['demand_tokens']} of running requests")
    return goal_row(f"{name}: more requests than the KV cache holds, answered / sent", value, "= 1",
                    None if value is None else value == 1.0, notes)


def within_a_block(kv: dict) -> str | None:
    """A note when the cache misses its share of the free memory by less than one block."""
    if "block_bytes" not in kv:  # a file from before it was recorded
        return None
    short = GOALS["kv_of_free"] * kv["free_bytes"] - kv["held_kv_bytes"]
    return "short by less than one KV block (the plan takes whole blocks)" if 0 < short < kv["block_bytes"] else None


def goals(results: dict) -> list[dict]:
    """Issue 28's goals as ratios of this run, each with its target, whether it is met (None: not
    measured) and a note saying what is missing or what failed. Rows are matched by client count
    and scenario, never by position."""
    ours, peer = results.get(OURS), results.get(PEER)
    rows = tokens_goals(ours, peer) if ours is not None and peer is not None else []
    for name in SERVERS:
        out = results.get(name)
        if out is None:
            continue
        s = out.get("scenarios", {})

        def get(key: str, out: dict = out, s: dict = s) -> dict | None:
            return s.get(key, server_failure(out))

        rows += [long_goal(name, get("long_alone"), get("long_joined")),
                 prefix_goal(name, get("prefix_cached"), get("prefix_uncached")),
                 overflow_goal(name, get("overflow"))]
    if ours is not None:
        kv = ours.get("kv", server_failure(ours))
        missing = why_not("kv", kv)
        value = kv["held_of_free"] if kv is not None and not missing else None
        rows.append(goal_row("shard-operator: KV cache held / free memory of its plan", value, ">= 0.9",
                             None if value is None else value >= GOALS["kv_of_free"],
                             [missing, kv is not None and not missing and within_a_block(kv)]))
    return rows


def fmt(value: float | None, digits: int = 3, scale: float = 1.0) -> str:
    return "-" if value is None or math.isnan(value) else f"{scale * value:.{digits}f}"


def shown_ratio(value: float, target: str, met: bool | None) -> str:
    """Two decimals, or six where two would round a miss onto its target (0.8999 of >= 0.9)."""
    shown = f"{value:.2f}"
    return f"{value:.6f}" if met is False and shown == f"{float(target.split()[-1]):.2f}" else shown


def table(results: dict) -> str:
    """The whole report: per server and client count, then the scenarios, then the goals."""
    lines = ["| server | clients | requests | failed | tokens/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | load |",
             "|---|---|---|---|---|---|---|---|"]
    for name in SERVERS:
        out = results.get(name)
        if out is None:
            continue
        if out.get("not_measured"):
            lines.append(f"| {name} | - | - | - | failed ({out['not_measured']}) | | | |")
        for r in out.get("throughput", []):
            if "not_measured" in r and "requests" not in r:
                lines.append(f"| {name} | {r['clients']} | - | - | failed ({r['not_measured']}) | | | |")
                continue
            failed = f"{r['failed']}" + (f" ({'; '.join(r['errors'])})" if r["failed"] else "")
            lines.append(f"| {name} | {r['clients']} | {r['requests']} | {failed} | "
                         f"{fmt(r.get('tokens_per_s'), 1)} | {fmt(r.get('ttft_p50'))} / {fmt(r.get('ttft_p99'))} | "
                         f"{fmt(r.get('itl_p50'), 1, 1e3)} / {fmt(r.get('itl_p99'), 1, 1e3)} | {r['load']:.1f} |")
    for name in SERVERS:
        out = results.get(name)
        if out is None:
            continue
        for scenario, value in out.get("scenarios", {}).items():
            lines.append(f"\n{name} {scenario}: {json.dumps(value)}")
        if out.get("kv"):
            lines.append(f"\n{name} KV cache: {json.dumps(out['kv'])}")
    lines += ["", "Issue 28's goals, ratios of this run:", "", "| goal | ratio | target | met | note |",
              "|---|---|---|---|---|"]
    for g in goals(results):
        shown = "not measured" if g["value"] is None else shown_ratio(g["value"], g["target"], g["met"])
        met = "-" if g["met"] is None else "yes" if g["met"] else "NO"
        lines.append(f"| {g['goal']} | {shown} | {g['target']} | {met} | {g['note']} |")
    return "\n".join(lines)
