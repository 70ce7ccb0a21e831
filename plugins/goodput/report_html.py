"""``loopkit report LOGDIR [-o FILE]``: the run's life as one self-contained HTML page.

Drawn by hand in inline SVG (no library, nothing fetched when the page opens): each
session as a bar on a wall-clock axis, patterned and labelled by how it ended; the
downtime between sessions and the runner's restarts; rollbacks; the machines named at
fault (replica mismatch, compute fault, straggler) as markers; durable and local saves
as ticks; the step reached and the goodput so far over time; badput by cause; the
figures of ``loopkit goodput``; and a table of the sessions, a hang's report one click
away. Patterns, shapes and labels, not colour alone, tell the endings and the faults apart
(a greyscale print keeps them).
"""

from __future__ import annotations

import html
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

from loopkit import storage
from loopkit.plugins.goodput.output import FAULT_WORDS, count_faults, tier_words
from loopkit.plugins.goodput.records import Fault
from loopkit.plugins.goodput.report import CAUSES, _hms, format_report
from loopkit.plugins.goodput.timeline import Timeline, build
from loopkit.plugins.goodput.svg import (
    Axis, chart, fault_marker, legend_swatch, nice_step, pattern_defs,
)

__all__ = ["render", "write_report"]

WIDTH, LEFT, RIGHT = 1000, 120, 30
#: how each ending is drawn: (fill, its words in the legend)
ENDINGS = {
    "finished": ("url(#p-finished)", "finished"),
    "preempted": ("url(#p-preempted)", "preempted (signal)"),
    "crashed": ("url(#p-crashed)", "crashed (exit code or signal)"),
    "hung": ("url(#p-hung)", "hung (watchdog, exit 75)"),
    "refused": ("url(#p-refused)", "refused (logdir taken)"),
    "running": ("url(#p-running)", "running"),
}
#: each fault cause's words in the legend
FAULT_LEGEND = {"sdc": "replica mismatch (sdc)", "compute": "compute fault",
                "straggler": "straggler"}
STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#111;max-width:1040px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 6px}
table{border-collapse:collapse} td,th{border:1px solid #999;padding:3px 8px;text-align:left;
vertical-align:top} th{background:#eee} svg text{font:12px system-ui,sans-serif}
pre{white-space:pre-wrap;font-size:11px;max-height:400px;overflow:auto;background:#f6f6f6}
.muted{color:#555} #errors:empty{display:none} #errors{color:#b00}
"""
# records an error of the page's own script into the page, where a test (or a reader)
# sees it; the page needs no script to be read
CATCH = """
window.addEventListener("error", function (e) {
  var box = document.getElementById("errors") || document.documentElement;
  box.textContent += "error: " + e.message + "\\n";
});
"""
SCRIPT = """
document.body.setAttribute("data-sessions", String(document.querySelectorAll(
  "#timeline g.session").length));
document.body.setAttribute("data-faults", String(document.querySelectorAll(
  "#timeline g.fault").length));
"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _figures(tl: Timeline) -> str:
    r = tl.report
    rows = [
        ("goodput", f"{100 * r.fraction:.1f} %", "productive time over wall time"),
        ("wall", _hms(r.wall_secs), "first process start to the last record"),
        ("productive", _hms(r.productive_secs), "steps that were kept"),
        ("badput", _hms(r.badput_secs()), "every other second, by cause below"),
        ("sessions", str(r.sessions), ""),
        ("interruptions", str(r.interruptions), "sessions that ended without finishing"),
        ("rollbacks", str(r.rollbacks), ""),
        ("mean time between interruptions", _hms(r.mtbi_secs), ""),
        ("save cost", _hms(r.save_cost_secs), "the loop held, plus the commit's slowdown"),
        ("save_model_secs=\"auto\" would pick", _hms(r.suggested_save_secs), ""),
    ]
    if r.suggested_local_secs is not None:  # a local tier: process deaths are its job
        rows[6:6] = [("process deaths / lost machines",
                      f"{r.process_deaths} / {r.lost_machines}",
                      "the machine lived (the local tier's job) / was lost")]
        rows += [("save_local_secs=\"auto\" would pick", _hms(r.suggested_local_secs),
                  "from the interruptions the local tier restores")]
    body = "".join(f"<tr><th>{_e(a)}</th><td class=\"figure\" data-name=\"{_e(a)}\">{_e(b)}"
                   f"</td><td class=\"muted\">{_e(c)}</td></tr>" for a, b, c in rows)
    return f'<table id="figures">{body}</table>'


def _timeline(tl: Timeline, axis: Axis) -> str:
    """The sessions lane, restarts, downtime, rollbacks, faults and the saves' ticks."""
    top, bar_h, height = 40, 34, 304
    parts = [f'<text x="8" y="{top + 22}">sessions</text>',
             f'<text x="8" y="{top + 86}">durable saves</text>',
             f'<text x="8" y="{top + 116}">local saves</text>',
             f'<text x="8" y="{top + 146}">faults</text>']
    rows = tl.sessions
    for i, row in enumerate(rows):
        x0, x1 = axis.x(row["start"]), max(axis.x(row["end"]), axis.x(row["start"]) + 3)
        fill, _ = ENDINGS.get(row["ended"], ENDINGS["crashed"])
        tip = (f"session {row['session']}: {row['label']}; {_when(row['start'])} to "
               f"{_when(row['end'])}; steps {row['first_step']}..{row['last_step']}; "
               f"{_restored(row)}")
        parts.append(
            f'<g class="session" data-ended="{_e(row["ended"])}" '
            f'data-tier="{_e(row["restored_tier"] or "fresh")}"><title>{_e(tip)}</title>'
            f'<rect x="{x0:.1f}" y="{top}" width="{x1 - x0:.1f}" height="{bar_h}" '
            f'fill="{fill}" stroke="#000" stroke-width="1"/>'
            f'<text x="{x0 + 2:.1f}" y="{top - 6 - 13 * (i % 2)}">#{row["session"]} '
            f'{_e(row["label"][:48])}</text></g>')
        if i + 1 < len(rows):  # the downtime up to the next process's start
            nx = axis.x(rows[i + 1]["start"])
            if nx > x1 + 1:
                secs = rows[i + 1]["start"] - row["end"]
                parts.append(
                    f'<g class="downtime"><title>downtime {_e(_hms(secs))}</title>'
                    f'<rect x="{x1:.1f}" y="{top + 12}" width="{nx - x1:.1f}" height="10" '
                    f'fill="url(#p-down)" stroke="#666"/></g>')
    for t, kind, exit_ in tl.restarts:
        x = axis.x(t)
        parts.append(f'<g class="restart"><title>loopkit run restarted it ({_e(kind)}'
                     f'{", " + _e(exit_) if exit_ else ""})</title>'
                     f'<path d="M{x - 5:.1f},{top + bar_h + 14} l5,-9 l5,9 z" fill="#000"/>'
                     f'<text x="{x + 7:.1f}" y="{top + bar_h + 14}">restart'
                     f'{" (" + _e(exit_) + ")" if exit_ else ""}</text></g>')
    for t, step, to_step, reason in tl.rollbacks:
        x = axis.x(t)
        parts.append(f'<g class="rollback"><title>rollback: {_e(reason)}</title>'
                     f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 4}" y2="{top + 124}" '
                     f'stroke="#000" stroke-width="2" stroke-dasharray="6,3"/>'
                     f'<text x="{x + 4:.1f}" y="{top + 64}">rollback {step}&#8594;{to_step}'
                     f'</text></g>')
    for t, step, tier in tl.saves:
        x, y = axis.x(t), top + (76 if tier == "durable" else 106)
        parts.append(f'<line class="save {_e(tier)}" x1="{x:.1f}" x2="{x:.1f}" y1="{y}" '
                     f'y2="{y + 14}" stroke="#000" stroke-width="{2 if tier == "durable" else 1}">'
                     f'<title>{_e(tier)} save of step {step}</title></line>')
    parts.append(_fault_markers(tl, axis, top + 142))
    parts.append(axis.draw(top + 164))
    parts.append(_legend(top + 226))
    return chart("timeline", "The run's life: sessions, restarts, rollbacks, faults and saves",
                 height, "".join(parts))


def _restored(row: dict[str, Any]) -> str:
    """What a session restored, in words ("peer" spelled out as the local tier's peer copy)."""
    if row["restored_tier"] is None:
        return "fresh start"
    return f"step {row['restored_step']} ({tier_words(row['restored_tier'])})"


def _fault_tip(number: int, f: Fault) -> str:
    where = f"process {f.process} on host {f.host}"
    if f.device is not None:
        where += f", device {f.device}"
    words = FAULT_WORDS.get(f.cause, f.cause)
    tip = f"{words} at step {f.step}, {_when(f.time)}: {where} (session {number})"
    if f.detail:
        tip += f"; {f.detail}"
    if f.cause == "straggler" and f.secs:
        tip += f"; the others waited {_hms(f.secs)}"
    return tip


def _fault_markers(tl: Timeline, axis: Axis, y: int) -> str:
    """Each fault's marker at its time, its shape by cause, named in a label where there
    is room (a straggler can be named every window: labels would overlap)."""
    parts, room = [], float("-inf")
    xs = [axis.x(f.time) for _, f in tl.faults] + [float("inf")]
    for k, (number, f) in enumerate(tl.faults):
        x, label, text = xs[k], f"{f.cause} p{f.process}", ""
        end = x + 14 + 7 * len(label)  # the label's end, at about 7 px a character
        if x >= room and xs[k + 1] > end:  # clear of the labels before and the next marker
            text = f'<text x="{x + 8:.1f}" y="{y + 4}">{_e(label)}</text>'
            room = end
        parts.append(f'<g class="fault" data-cause="{_e(f.cause)}" data-process="{f.process}">'
                     f'<title>{_e(_fault_tip(number, f))}</title>'
                     f'{fault_marker(f.cause, x, y)}{text}</g>')
    return "".join(parts)


def _legend(y: int) -> str:
    items: list[tuple[str | None, str]] = [(fill, words) for fill, words in ENDINGS.values()]
    items.append(("url(#p-down)", "downtime (no trainer)"))
    items += [(None, cause) for cause in FAULT_LEGEND]
    out, x = [], LEFT
    for fill, words in items:
        if fill is None:  # a fault's marker, by cause
            cause, words = words, FAULT_LEGEND[words]
            out.append(f'<g class="legend-fault" data-cause="{cause}">'
                       f'{fault_marker(cause, x + 11, y - 4)}'
                       f'<text x="{x + 27}" y="{y}">{_e(words)}</text></g>')
        else:
            out.append(legend_swatch(x, y, fill, words))
        x += 30 + 7 * len(words)
        if x > WIDTH - 150:
            x, y = LEFT, y + 22
    return '<g class="legend">' + "".join(out) + "</g>"


def _line_chart(name: str, title: str, series: Sequence[Sequence[tuple[float, float]]],
                axis: Axis, y_label: str, y_max: float, y_fmt: str) -> str:
    top, plot_h = 20, 150
    y_max = y_max or 1.0

    def y(v: float) -> float:
        return top + plot_h - plot_h * v / y_max

    parts = [f'<text x="8" y="{top + 8}" class="muted">{_e(y_label)}</text>']
    tick = nice_step(y_max / 4)
    y_max = tick * math.ceil(y_max / tick)
    for k in range(int(round(y_max / tick)) + 1):
        v = tick * k
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                     f'stroke="#ccc"/><text x="{LEFT - 6}" y="{y(v) + 4:.1f}" '
                     f'text-anchor="end">{format(v, y_fmt)}</text>')
    for points in series:
        if points:
            d = " ".join(f"{axis.x(t):.1f},{y(v):.1f}" for t, v in points)
            parts.append(f'<polyline points="{d}" fill="none" stroke="#000" stroke-width="2"/>')
    parts.append(axis.draw(top + plot_h + 4))
    return chart(name, title, top + plot_h + 50, "".join(parts))


def _badput(tl: Timeline) -> str:
    r = tl.report
    rows = [("productive", r.productive_secs)]
    for cause in CAUSES:
        v = r.badput[cause]
        rows.append((cause, sum(v.values()) if isinstance(v, dict) else float(v)))
    wall = r.wall_secs or 1.0
    longest = max(v for _, v in rows) or 1.0
    parts = []
    for i, (cause, secs) in enumerate(rows):
        y, w = 10 + 22 * i, (WIDTH - LEFT - RIGHT - 160) * secs / longest
        parts.append(f'<g class="cause" data-cause="{cause}"><text x="{LEFT - 6}" y="{y + 13}" '
                     f'text-anchor="end">{cause}</text><rect x="{LEFT}" y="{y}" '
                     f'width="{w:.1f}" height="16" fill="{"#333" if i == 0 else "url(#p-down)"}"'
                     f' stroke="#000"/><text x="{LEFT + w + 6:.1f}" y="{y + 13}">'
                     f'{_e(_hms(secs))} ({100 * secs / wall:.1f} %)</text></g>')
    return chart("badput", "Where the wall time went: productive, and badput by cause",
                 20 + 22 * len(rows), "".join(parts))


def _sessions_table(tl: Timeline) -> str:
    head = ("<tr><th>#</th><th>process start</th><th>last record</th><th>ended</th>"
            "<th>steps</th><th>restored</th><th>details</th></tr>")
    body = []
    for r in tl.sessions:
        restored = _restored(r)
        details = []
        if r["hang_report"]:
            details.append(f'<details class="hang"><summary>hang report</summary>'
                           f'<pre>{_e(r["hang_report"])}</pre></details>')
        if r["rollbacks"]:
            details.append(f"{r['rollbacks']} rollback(s)")
        if r["faults"]:
            details.append(f'<span class="faults">{_e(count_faults(r["faults"]))}</span>')
        steps = f"{r['first_step']}..{r['last_step']}" if r["last_step"] is not None else "-"
        body.append(f'<tr class="session-row" data-ended="{_e(r["ended"])}" '
                    f'data-tier="{_e(r["restored_tier"] or "fresh")}"><td>{r["session"]}'
                    f'</td><td>{_e(_when(r["start"]))}</td><td>{_e(_when(r["end"]))}</td>'
                    f'<td>{_e(r["label"])}</td><td>{steps}</td><td>{_e(restored)}</td>'
                    f'<td>{"; ".join(details)}</td></tr>')
    return f'<table id="sessions">{head}{"".join(body)}</table>'


def _faults_table(tl: Timeline) -> str:
    if not tl.faults:
        return '<p id="faults" class="muted">none</p>'
    head = ("<tr><th>time</th><th>session</th><th>fault</th><th>step</th><th>process</th>"
            "<th>host</th><th>device</th><th>detail</th></tr>")
    body = "".join(
        f'<tr class="fault-row" data-cause="{_e(f.cause)}"><td>{_e(_when(f.time))}</td>'
        f'<td>{n}</td><td>{_e(FAULT_LEGEND.get(f.cause, f.cause))}</td><td>{f.step}</td>'
        f'<td>{f.process}</td><td>{_e(f.host)}</td>'
        f'<td>{"-" if f.device is None else f.device}</td><td>{_e(f.detail)}'
        f'{"; the others waited " + _e(_hms(f.secs)) if f.cause == "straggler" else ""}'
        f'</td></tr>' for n, f in tl.faults)
    return f'<table id="faults">{head}{body}</table>'


def render(tl: Timeline) -> str:
    """The report page of `tl`, one HTML string with everything inline."""
    axis = Axis(tl.t0, tl.t1, LEFT, WIDTH - RIGHT)
    last = tl.sessions[-1]
    if last["ended"] == "running":
        status = f"running: last record {_hms(time.time() - tl.t1)} ago"
    else:
        status = f"not running; the last session {last['label']}"
    steps = [[(t, float(s)) for t, s in points] for points in tl.steps]
    top_step = max((s for points in steps for _, s in points), default=1.0)
    goodput = [[(t, 100 * f) for t, f in tl.goodput]]
    rollbacks = "".join(f"<li>at {_e(_when(t))}: step {s} back to {to} ({_e(why)})</li>"
                        for t, s, to, why in tl.rollbacks)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>loopkit report: {_e(tl.logdir)}</title>
<style>{STYLE}</style><script>{CATCH}</script></head><body>{pattern_defs()}
<h1>loopkit run report</h1>
<p><b>{_e(tl.logdir)}</b><br>from {_e(_when(tl.t0))} to {_e(_when(tl.t1))}
({_e(_hms(tl.t1 - tl.t0))}); <span id="status">{_e(status)}</span></p>
<div id="errors"></div>
<h2>The figures of <code>loopkit goodput</code></h2>{_figures(tl)}
<h2>The run's life</h2>{_timeline(tl, axis)}
<h2>Step reached</h2>{_line_chart("steps", "Global step over time", steps, axis,
                                   "global step", top_step, ".0f")}
<h2>Goodput so far</h2>{_line_chart("goodput", "Goodput of the run so far, over time",
                                     goodput, axis, "goodput (%)", 100.0, ".0f")}
<h2>Badput by cause</h2>{_badput(tl)}
<h2>Sessions</h2>{_sessions_table(tl)}
<h2>Rollbacks</h2><ul id="rollbacks">{rollbacks or "<li>none</li>"}</ul>
<h2>Machines named at fault</h2>{_faults_table(tl)}
<h2>As <code>loopkit goodput</code> prints it</h2><pre>{_e(format_report(tl.report))}</pre>
<script>{SCRIPT}</script>
</body></html>
"""


def write_report(logdir: Path | str, output: str | os.PathLike[str] | None = None) -> str:
    """Write the report of the run in `logdir` to `output` (default ``LOGDIR/report.html``;
    for a URL logdir, ``report.html`` in the working directory); return its path."""
    tl = build(logdir)
    page = render(tl)
    if output is None:
        output = ("report.html" if storage.is_url(tl.logdir)
                  else os.path.join(tl.logdir, "report.html"))
    Path(output).write_text(page, encoding="utf-8")
    return str(output)
