"""The placement picture: a group's ranks as SVG, pipeline stages left to right, tensor-parallel
ranks stacked, each rank's memory against its device's capacity.

One drawing for both planes: `shardctl plan --svg/--html` draws a plan before anything runs (a
`ShardEntry(plan=rank, state="planned")` of every rank), and every leader's `/dashboard` draws its group live from the
very entries `/v1/shards` answers (measured resident bytes and health added). Pure: entries in,
SVG text out, no script and no external reference, so the text can be embedded anywhere.

Each rank's bar is scaled to its own device: predicted weights / KV cache / activations / overhead
(and the staging slots of a rank that streams layers) stacked, the headroom (capacity minus usable)
shaded at the right end, and the measured resident total as a thin bar beneath. A rank that is not
alive, or failed, is drawn red with the reason.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

from .plan import describe_layers
from .units import human
from .wire import ShardEntry

KINDS = (("weights", "weights", "#4e79a7"), ("kv_cache", "KV cache", "#59a14f"),
         ("activations", "activations", "#f28e2b"), ("overhead", "overhead", "#9c9c9c"))
STAGING = ("staging", "staging (streamed layers)", "#b07aa1")  # drawn only where a rank streams
RESIDENT = "#7b3294"
HEADROOM = "#e6e6e6"
DEAD, DEAD_FILL = "#d62728", "#fde3e3"
FONT = "font-family:DejaVu Sans,Helvetica,Arial,sans-serif"

BOX_W, BOX_H, GAP_X, GAP_Y, PAD = 300, 118, 44, 12, 16
BAR_X, BAR_W = 10, BOX_W - 20


class Svg:
    """An SVG document built element by element (numbers rounded, text escaped)."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, element: str) -> None:
        self.parts.append(element)

    def rect(self, x: float, y: float, w: float, h: float, fill: str, title: str = "", **attrs: str) -> None:
        extra = "".join(f" {'class' if k == 'cls' else k.replace('_', '-')}={quoteattr(v)}" for k, v in attrs.items())
        tip = f"<title>{escape(title)}</title>" if title else ""
        self.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{h:.1f}" fill="{fill}"{extra}>'
                 f"{tip}</rect>")

    def text(self, x: float, y: float, content: str, size: int = 12, cls: str = "", fill: str = "#222",
             weight: str = "normal", anchor: str = "start") -> None:
        klass = f' class="{cls}"' if cls else ""
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" fill="{fill}" font-weight="{weight}" '
                 f'text-anchor="{anchor}"{klass}>{escape(content)}</text>')

    def lines(self, x: float, y: float, content: str, width: int, size: int = 12, fill: str = "#222",
              cls: str = "") -> float:
        """`content` wrapped at `width` characters; returns the y below it."""
        for paragraph in content.splitlines():
            for line in textwrap.wrap(paragraph, width) or [""]:
                self.text(x, y, line, size=size, fill=fill, cls=cls)
                y += size + 4
        return y

    def render(self, width: float, height: float) -> str:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
                f'viewBox="0 0 {width:.0f} {height:.0f}" style="{FONT}">'
                f'<rect width="100%" height="100%" fill="#fff"/>{"".join(self.parts)}</svg>\n')


def legend(svg: Svg, left: float, y: float, width: float, measured: bool, staging: bool = False) -> float:
    """The colours' key, wrapped within `width`; returns the y below it."""
    items = [(label, color) for _, label, color in (*KINDS, *([STAGING] if staging else []))] + [("headroom", HEADROOM)]
    if measured:
        items.append(("measured resident", RESIDENT))
    x = left
    for label, color in items:
        step = 24 + 7 * len(label)
        if x + step > left + width:
            x, y = left, y + 18
        svg.rect(x, y - 10, 12, 12, color, stroke="#999")
        svg.text(x + 16, y, label, size=11)
        x += step
    return y + 8


def dead(entry: ShardEntry) -> bool:
    return not entry.alive or entry.state in ("failed", "broken")


def rank_box(svg: Svg, entry: ShardEntry, x: float, y: float, reason: str) -> None:
    rp = entry.plan
    p, res = rp.predicted_bytes, entry.report.resident_bytes if entry.report is not None else None
    bad = dead(entry)
    state = "dead" if not entry.alive else entry.state
    svg.add(f'<g class="rank" data-rank="{rp.rank}" data-stage="{rp.stage}" data-tp-rank="{rp.tp_rank}" '
            f'data-alive="{str(not bad).lower()}" data-state="{escape(state)}" data-predicted="{p.total}" '
            f'data-resident="{res.total if res else ""}" data-capacity="{rp.capacity_bytes}" '
            f'data-usable="{rp.usable_bytes}">')
    svg.rect(x, y, BOX_W, BOX_H, DEAD_FILL if bad else "#fafafa", stroke=DEAD if bad else "#999",
             stroke_width="3" if bad else "1", rx="6")
    svg.text(x + 10, y + 18, f"rank {rp.rank} · tp {rp.tp_rank}", size=13, weight="bold")
    svg.text(x + BOX_W - 10, y + 18, state, size=12, anchor="end", cls="state", fill=DEAD if bad else "#555",
             weight="bold" if bad else "normal")
    svg.text(x + 10, y + 34, f"{rp.node} · {rp.device}", size=11, fill="#555", cls="where")
    scale = BAR_W / max(rp.capacity_bytes, 1)
    bar_y, left = y + 42, x + BAR_X
    svg.rect(left, bar_y, BAR_W, 16, "#fff", stroke="#bbb")
    svg.rect(left + rp.usable_bytes * scale, bar_y, (rp.capacity_bytes - rp.usable_bytes) * scale, 16,
             HEADROOM, f"headroom {human(rp.capacity_bytes - rp.usable_bytes)}")
    for kind, label, color in (*KINDS, *([STAGING] if p.staging else [])):
        n = getattr(p, kind)
        width = min(n * scale, x + BAR_X + BAR_W - left)  # a plan never overfills; clipped all the same
        svg.rect(left, bar_y, width, 16, color, f"predicted {label} {human(n)}")
        left += width
    svg.add(f'<line x1="{x + BAR_X + rp.usable_bytes * scale:.1f}" y1="{bar_y - 3:.1f}" '
            f'x2="{x + BAR_X + rp.usable_bytes * scale:.1f}" y2="{bar_y + 28:.1f}" stroke="#444" '
            f'stroke-dasharray="3,2"><title>usable: {human(rp.usable_bytes)}</title></line>')
    if res is not None:
        over = res.total > rp.capacity_bytes
        svg.rect(x + BAR_X, bar_y + 19, min(res.total * scale, BAR_W), 7, DEAD if over else RESIDENT,
                 f"measured resident {human(res.total)}")
    measured = (f" · resident {human(res.total)}" if res is not None
                else f", {p.total / max(rp.capacity_bytes, 1):.0%} of the device" if entry.state == "planned"
                else " · not measured yet")
    svg.text(x + 10, y + 82, f"predicted {human(p.total)}{measured}", size=11, cls="memory")
    svg.text(x + 10, y + 97, f"of {human(rp.capacity_bytes)}; usable {human(rp.usable_bytes)}", size=11,
             fill="#555", cls="capacity")
    note = (reason if bad and f"rank {rp.rank} " in reason + " " else "not alive" if bad
            else "memory check failed" if entry.problems else "")
    if note:
        svg.text(x + 10, y + BOX_H - 6, note[:52] + ("…" if len(note) > 52 else ""), size=10, fill=DEAD,
                 cls="reason")
    svg.add("</g>")


def group_svg(ranks: Sequence[ShardEntry], title: str = "", reason: str = "") -> str:
    """The picture of one group. `reason`: why the group is not ready or not alive (drawn in red
    when a rank is dead, and beside each rank it names)."""
    stages = sorted({r.plan.stage for r in ranks})
    tp = max((r.plan.tp_rank for r in ranks), default=0) + 1
    width = PAD * 2 + len(stages) * BOX_W + (len(stages) - 1) * GAP_X
    svg = Svg()
    y: float = PAD + 4
    if title:
        svg.text(PAD, y + 12, title, size=15, weight="bold", cls="title")
        y += 24
    broken = any(dead(r) for r in ranks)
    if broken and reason:
        y = svg.lines(PAD, y + 12, reason, max(40, width // 7), fill=DEAD, cls="group-reason") - 4
    top = y + 8
    for column, stage in enumerate(stages):
        members = sorted((r for r in ranks if r.plan.stage == stage), key=lambda r: r.plan.tp_rank)
        x = PAD + column * (BOX_W + GAP_X)
        layers = describe_layers(members[0].plan.layers)  # '0-31 (32 layers)'
        if members[0].plan.offload:
            layers = f"{layers.removesuffix(')')}, {len(members[0].plan.offload.layers)} streamed)"
        parts = [f"layers {layers}"]
        parts += ["embeddings"] if stage == stages[0] else []
        parts += ["LM head"] if stage == stages[-1] else []
        svg.text(x, top + 12, f"stage {stage}", size=13, weight="bold")
        svg.text(x + 62, top + 12, " + ".join(parts), size=12, fill="#555", cls="layers")
        for row, entry in enumerate(members):
            rank_box(svg, entry, x, top + 22 + row * (BOX_H + GAP_Y), reason)
        if column:
            mid = top + 22 + (tp * (BOX_H + GAP_Y) - GAP_Y) / 2
            svg.add(f'<path d="M{x - GAP_X + 6:.1f},{mid:.1f} H{x - 8:.1f} l-7,-5 v10 l7,-5" stroke="#666" '
                    f'fill="#666"/>')
    bottom = legend(svg, PAD, top + 22 + tp * (BOX_H + GAP_Y) + 10, width - 2 * PAD,
                    measured=any(r.report is not None for r in ranks),
                    staging=any(r.plan.predicted_bytes.staging for r in ranks))
    return svg.render(width, bottom + PAD)
