"""One explainer page: its controls, its table of precomputed values, and the HTML that holds both.

Every number a page shows is computed here, in Python, by fivefold's own functions, for every
discrete position of every control, and written into the page as one JSON table. The page's
JavaScript only looks entries up and draws them, so what the page says is what fivefold computes
(tests/viz/test_pages.py reads the numbers back from a real browser and checks them against Python).

A table key joins the keyed controls' values in control order: "schedule=1f1b|p=4|m=8|v=1".
Control values are ints or strings only, so that Python's str() and JavaScript's String() agree.
The page is one self-contained file: CSS, scripts and data inline, nothing fetched.
"""

from __future__ import annotations

import html
import itertools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATIC = Path(__file__).parent / "static"


@dataclass(frozen=True)
class Control:
    """A select (few named choices) or a slider (ordered positions) over discrete values."""

    name: str
    label: str
    values: tuple[int | str, ...]
    kind: str = "select"  # "select" or "slider"
    default: int | str | None = None  # a value; None = the first
    labels: tuple[str, ...] = ()  # text shown per value; default str(value)
    keyed: bool = True  # False: the page's script reads it inside an entry (the ring's step)

    def __post_init__(self) -> None:
        if any(not isinstance(v, (int, str)) or isinstance(v, bool) for v in self.values):
            raise TypeError(f"control {self.name}: values must be ints or strings (str() must match JavaScript)")
        if self.labels and len(self.labels) != len(self.values):
            raise ValueError(f"control {self.name}: one label per value")

    def label_of(self, value: int | str) -> str:
        return self.labels[self.values.index(value)] if self.labels else str(value)


def table_key(values: dict[str, int | str]) -> str:
    return "|".join(f"{k}={v}" for k, v in values.items())


@dataclass
class Page:
    """What one explainer module provides; `build_table` fills `table` (see `positions`)."""

    slug: str  # file name without .html
    title: str
    summary: str  # one line for the index
    intro: str  # HTML paragraphs above the controls
    controls: list[Control]
    entry: Callable[..., dict[str, Any]]  # keyed control values as keywords -> the entry
    body: str  # HTML below the controls: the elements the page's script fills
    script: str  # file in static/ with the page's render(entry) function
    notes: str = ""  # HTML below the figure: where the numbers come from
    table: dict[str, Any] = field(default_factory=dict)

    def positions(self) -> Iterator[dict[str, int | str]]:
        """Every combination of the keyed controls' positions."""
        keyed = [c for c in self.controls if c.keyed]
        for combo in itertools.product(*(c.values for c in keyed)):
            yield {c.name: v for c, v in zip(keyed, combo, strict=True)}

    def count(self) -> int:
        return math.prod(len(c.values) for c in self.controls if c.keyed)

    def build_table(self, advance: Callable[[], None] = lambda: None) -> None:
        for pos in self.positions():
            self.table[table_key(pos)] = self.entry(**pos)
            advance()


def _control_html(c: Control) -> str:
    default = c.values[0] if c.default is None else c.default
    label = html.escape(c.label)
    if c.kind == "select":
        options = "".join(
            f'<option value="{html.escape(str(v))}"{" selected" if v == default else ""}>'
            f"{html.escape(c.label_of(v))}</option>" for v in c.values)
        return (f'<label class="control">{label} <select id="ctl-{c.name}" data-control="{c.name}">'
                f'{options}</select></label>')
    if c.kind == "slider":
        values = html.escape(json.dumps(list(c.values)))
        labels = html.escape(json.dumps([c.label_of(v) for v in c.values]))
        return (f'<label class="control">{label} <input type="range" id="ctl-{c.name}" data-control="{c.name}" '
                f'min="0" max="{len(c.values) - 1}" step="1" '
                f'value="{c.values.index(default)}" data-values="{values}" data-labels="{labels}">'
                f'<output id="out-{c.name}">{html.escape(c.label_of(default))}</output></label>')
    raise ValueError(f"control {c.name}: unknown kind {c.kind!r}")


def _json_for_script(data: Any) -> str:
    # Inside <script>, "</" could end the element early; "<\/" is the same string to JSON.
    return json.dumps(data, separators=(",", ":")).replace("</", "<\\/")


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{title} - fivefold</title>
<style>{css}</style>
</head>
<body>
<nav><a href="index.html">fivefold explainers</a></nav>
<h1>{title}</h1>
{intro}
<form id="controls" onsubmit="return false">{controls}</form>
<p id="error" class="error" role="alert"></p>
<main id="page">{body}</main>
<div class="notes">{notes}</div>
<script type="application/json" id="data">{data}</script>
<script>{common}</script>
<script>{script}</script>
<script>Explain.start(render);</script>
</body>
</html>
"""


def render_page(page: Page) -> str:
    data = {"controls": [{"name": c.name, "keyed": c.keyed} for c in page.controls], "table": page.table}
    return _TEMPLATE.format(
        title=html.escape(page.title), intro=page.intro, body=page.body, notes=page.notes,
        controls="".join(_control_html(c) for c in page.controls), data=_json_for_script(data),
        css=(STATIC / "explain.css").read_text(), common=(STATIC / "common.js").read_text(),
        script=(STATIC / page.script).read_text())


def render_index(pages: list[Page]) -> str:
    items = "".join(f'<li><a href="{p.slug}.html">{html.escape(p.title)}</a>: {html.escape(p.summary)}</li>'
                    for p in pages)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<link rel="icon" href="data:,">
<title>fivefold explainers</title>
<style>{(STATIC / "explain.css").read_text()}</style>
</head>
<body>
<h1>fivefold explainers</h1>
<p>Each page works offline. Every number on it was computed by fivefold's own Python code for
every position of every control, and stored in the page; moving a control only looks it up.</p>
<ul class="index">{items}</ul>
</body>
</html>
"""
