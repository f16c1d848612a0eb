"""`fivefold explain`: self-contained HTML pages that show how fivefold's parallelism works.

Each page module (ring, buckets, pipeline, zero) describes its controls and computes one table
entry per position of its controls with fivefold's own functions; page.py writes the table, the
shared script and the page's drawing script into one HTML file that needs no server or network.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fivefold.progress import progress_bar
from fivefold.viz.explain import buckets, pipeline, ring, zero
from fivefold.viz.explain.page import Page, render_index, render_page

PAGE_BUILDERS: tuple[Callable[[], Page], ...] = (ring.page, buckets.page, pipeline.page, zero.page)


def write_pages(out: Path, progress: bool = True) -> list[Path]:
    """Compute every page's table and write the pages plus index.html into `out`; return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    pages = [build() for build in PAGE_BUILDERS]
    written = []
    # one bar over every table entry of every page: the pages differ a hundredfold in work
    with progress_bar(f"explain: {len(pages)} pages", sum(p.count() for p in pages), progress) as advance:
        for page in pages:
            page.build_table(advance)
            path = out / f"{page.slug}.html"
            path.write_text(render_page(page))
            written.append(path)
    index = out / "index.html"
    index.write_text(render_index(pages))
    return [index, *written]
