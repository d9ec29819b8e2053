"""`shardctl plan --svg FILE` and `--html FILE`: the placement picture of a plan before anything runs.

A plan that fits is drawn by `shard_contract.picture`, the very drawing every leader's
`/dashboard` shows live (there with measured memory and health). A request that fits nowhere is
drawn as what it needs (weights, KV cache, runtime per device) against what the pool offers, the
missing part in red, above the planner's own message. `--html` puts the same SVG in one
self-contained page with the plan's text table.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from xml.etree import ElementTree

from shard_contract.picture import DEAD, FONT, KINDS, PAD, Svg, group_svg
from shard_contract.plan import Plan
from shard_contract.units import human
from shard_contract.wire import ShardEntry

from . import PlanError, Shortfall

WIDTH = 900
BAR_H = 26
POOL_SHADES = ("#c6dbef", "#9ecae1")


def plan_svg(plan: Plan) -> str:
    """Every group of the plan, one under the other."""
    pictures = [group_svg([ShardEntry(plan=rp, state="planned") for rp in plan.group(g.replica)],
                          title=f"{plan.model}: TP={plan.tensor_parallel} x PP={plan.pipeline_parallel}, group "
                                f"{g.replica} (plan {plan.hash}, {plan.dtype})")
                for g in plan.groups]
    return stack(pictures)


def stack(pictures: list[str]) -> str:
    """SVG documents one under the other, in one document."""
    if len(pictures) == 1:
        return pictures[0]
    sizes = [(float(root.get("width", 0)), float(root.get("height", 0)))
             for root in map(ElementTree.fromstring, pictures)]
    y, parts = 0.0, []
    for picture, (_, height) in zip(pictures, sizes, strict=False):
        parts.append(picture.replace("<svg ", f'<svg y="{y:.0f}" ', 1))
        y += height
    width = max(w for w, _ in sizes)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y:.0f}" '
            f'viewBox="0 0 {width:.0f} {y:.0f}">{"".join(parts)}</svg>\n')


def infeasible_svg(err: PlanError, title: str) -> str:
    """What is missing, drawn: the need against the pool (when the planner measured it), then why."""
    svg = Svg()
    y: float = PAD + 16
    svg.text(PAD, y, title, size=15, weight="bold", cls="title")
    svg.text(PAD, y + 18, err.reason, size=12, fill=DEAD, weight="bold", cls="reason")
    y += 40
    if err.shortfall is not None:
        y = shortfall_bars(svg, err.shortfall, y)
    y = svg.lines(PAD, y + 14, err.message, width=(WIDTH - 2 * PAD) // 7, fill="#333", cls="message")
    return svg.render(WIDTH, y + PAD)


def shortfall_bars(svg: Svg, short: Shortfall, y: float) -> float:
    pool = sum(short.usable)
    left, span = PAD + 110, WIDTH - 2 * PAD - 110
    scale = span / max(short.need, sum(d.memory_bytes for d in short.devices), 1)
    needed = [(short.weights, KINDS[0][2], "weights"),
              (short.kv_cache, KINDS[1][2], "KV cache"),
              (len(short.usable) * short.per_device, KINDS[3][2],
               f"runtime and activations, {human(short.per_device)} x {len(short.usable)} devices")]
    svg.text(PAD, y + 17, "needed", size=12, weight="bold")
    x: float = left
    for n, color, label in needed:
        svg.rect(x, y, n * scale, BAR_H, color, f"{label}: {human(n)}", cls="need")
        x += n * scale
    svg.text(left, y + BAR_H + 14, f"at least {human(short.need)}: " + "; ".join(
        f"{label} {human(n)}" for n, _, label in needed), size=11, fill="#444")
    y += BAR_H + 34
    svg.text(PAD, y + 17, "the pool", size=12, weight="bold")
    x = left
    for i, (device, usable) in enumerate(zip(short.devices, short.usable, strict=False)):
        name = f"{device.node} {device.kind}:{device.index}"
        svg.rect(x, y, usable * scale, BAR_H, POOL_SHADES[i % 2], f"{name}: {human(usable)} usable of "
                 f"{human(device.memory_bytes)}", stroke="#6b8fb3", cls="device")
        if usable * scale > 8 * len(name):
            svg.text(x + 4, y + 17, name, size=10, fill="#234")
        x += usable * scale
    missing = short.need - pool
    if missing > 0:
        svg.rect(x, y, missing * scale, BAR_H, "#fde3e3", f"missing: {human(missing)}", stroke=DEAD,
                 stroke_width="2", stroke_dasharray="5,3", cls="missing")
        svg.text(x + 4, y + 17, f"missing {human(missing)}", size=11, fill=DEAD, weight="bold")
    summary = f"{human(pool)} usable on {len(short.usable)} devices"
    summary += f": {human(missing)} short" if missing > 0 else ": enough in total, but no split of the layers fits"
    svg.text(left, y + BAR_H + 14, summary, size=11, fill=DEAD)
    return y + BAR_H + 30


def html_page(title: str, svg: str, text: str) -> str:
    """One self-contained page: the picture and the text it stands for."""
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<style>body{{{FONT};margin:20px;color:#222}} pre{{font-size:12px;background:#f6f6f6;'
            f'padding:10px;overflow-x:auto}}</style></head>\n<body><h1 style="font-size:19px">{escape(title)}</h1>\n'
            f'<div id="picture">{svg}</div>\n<pre id="text">{escape(text)}</pre>\n</body></html>\n')


def write(svg: str, title: str, text: str, svg_file: str | None = None, html_file: str | None = None) -> None:
    """The picture as SVG and/or as a page, where asked."""
    if svg_file:
        Path(svg_file).write_text(svg)
    if html_file:
        Path(html_file).write_text(html_page(title, svg, text))
