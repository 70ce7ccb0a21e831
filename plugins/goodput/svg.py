"""The few SVG pieces `report_html` draws with: a wall-clock axis, a chart frame, the
fill patterns (distinct in greyscale) and a legend swatch."""

from __future__ import annotations

import html
import math
import time

__all__ = ["Axis", "chart", "fault_marker", "legend_swatch", "nice_step", "pattern_defs"]

#: (pattern id, SVG of one tile): stripes, hatches and dots that a greyscale print keeps
_PATTERNS = {
    "finished": '<rect width="8" height="8" fill="#1b5e20"/>',
    "preempted": '<rect width="8" height="8" fill="#fff3c4"/>'
                 '<path d="M0,8 l8,-8" stroke="#8a6d00" stroke-width="2"/>',
    "crashed": '<rect width="8" height="8" fill="#ffd0d0"/>'
               '<path d="M0,0 l8,8 M8,0 l-8,8" stroke="#a00000" stroke-width="1.5"/>',
    "hung": '<rect width="8" height="8" fill="#e0d4ff"/>'
            '<circle cx="4" cy="4" r="2" fill="#3d1a99"/>',
    "refused": '<rect width="8" height="8" fill="#ddd"/>'
               '<path d="M0,4 h8" stroke="#000" stroke-width="2"/>',
    "running": '<rect width="8" height="8" fill="#d8f0ff"/>'
               '<path d="M4,0 v8" stroke="#0b5394" stroke-width="1"/>',
    "down": '<rect width="8" height="8" fill="#fff"/>'
            '<path d="M0,0 l8,8" stroke="#888" stroke-width="1"/>',
}


def pattern_defs() -> str:
    """Every pattern, once per page (an SVG of no size; the others refer to its ids)."""
    tiles = "".join(f'<pattern id="p-{name}" width="8" height="8" '
                    f'patternUnits="userSpaceOnUse">{tile}</pattern>'
                    for name, tile in _PATTERNS.items())
    return f'<svg width="0" height="0" style="position:absolute" aria-hidden="true"><defs>{tiles}</defs></svg>'


def chart(name: str, title: str, height: int, inner: str, width: int = 1000) -> str:
    return (f'<svg id="{name}" role="img" aria-label="{html.escape(title)}" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}"><title>{html.escape(title)}</title>'
            f'{inner}</svg>')


def legend_swatch(x: float, y: float, fill: str, words: str) -> str:
    return (f'<rect x="{x:.0f}" y="{y - 11:.0f}" width="22" height="14" fill="{fill}" '
            f'stroke="#000"/><text x="{x + 27:.0f}" y="{y:.0f}">{html.escape(words)}</text>')


#: each fault cause's marker: (shape, fill); the shapes tell them apart in greyscale
FAULT_SHAPES = {"sdc": ("diamond", "#b00000"), "compute": ("square", "#e07000"),
                "straggler": ("circle", "#ffffff")}


def fault_marker(cause: str, x: float, y: float) -> str:
    """The marker of a fault of `cause` centred at (`x`, `y`): a filled diamond for a
    replica mismatch, a filled square for a compute fault, a hollow circle for a
    straggler, a cross for a cause this version does not know."""
    shape, fill = FAULT_SHAPES.get(cause, ("cross", "#000"))
    if shape == "diamond":
        return (f'<path d="M{x:.1f},{y - 7:.1f} l7,7 l-7,7 l-7,-7 z" fill="{fill}" '
                f'stroke="#000" stroke-width="1.5"/>')
    if shape == "square":
        return (f'<rect x="{x - 5.5:.1f}" y="{y - 5.5:.1f}" width="11" height="11" '
                f'fill="{fill}" stroke="#000" stroke-width="1.5"/>')
    if shape == "circle":
        return (f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5.5" fill="{fill}" stroke="#000" '
                f'stroke-width="2"/>')
    return (f'<path d="M{x - 5:.1f},{y - 5:.1f} l10,10 M{x + 5:.1f},{y - 5:.1f} l-10,10" '
            f'stroke="{fill}" stroke-width="2"/>')


def nice_step(raw: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten at least `raw` (> 0)."""
    mag = 10 ** math.floor(math.log10(max(raw, 1e-9)))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


class Axis:
    """Wall-clock time from `t0` to `t1` onto x from `left` to `right`, ticked in the unit
    that suits the span (s, min or h since `t0`)."""

    def __init__(self, t0: float, t1: float, left: float, right: float) -> None:
        self.t0, self.span = t0, max(t1 - t0, 1e-3)
        self.left, self.right = left, right
        span = self.span
        self.unit, self.scale = (("s", 1.0) if span < 300 else
                                 ("min", 60.0) if span < 5 * 3600 else ("h", 3600.0))

    def x(self, t: float) -> float:
        return self.left + (self.right - self.left) * min(max((t - self.t0) / self.span, 0), 1)

    def ticks(self) -> list[float]:
        """Round values (in the unit) from 0 to the span, 4 to 10 of them."""
        span = self.span / self.scale
        step = nice_step(span / 6)
        return [k * step for k in range(int(span / step) + 1)]

    def draw(self, y: float) -> str:
        """The axis line at `y`, its ticks and its label with the unit and the start."""
        parts = [f'<line x1="{self.left}" x2="{self.right}" y1="{y}" y2="{y}" stroke="#000"/>']
        for v in self.ticks():
            x = self.x(self.t0 + v * self.scale)
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + 5}" stroke="#000"/>'
                         f'<text x="{x:.1f}" y="{y + 18}" text-anchor="middle">{v:g}</text>')
        start = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.t0))
        parts.append(f'<text x="{(self.left + self.right) / 2:.0f}" y="{y + 34}" '
                     f'text-anchor="middle">wall-clock time ({self.unit} since the first '
                     f'process started, {start})</text>')
        return "".join(parts)
