"""The run report's layout timeline (viz/layout_timeline.py): which layout ran from which step to which."""

import json
import re

from fivefold.viz.layout_timeline import Segment, layout_segments
from fivefold.viz.report import build_report


def _layout(step, dp, tp=1):
    return {"step": step, "event": "layout", "world_size": dp * tp, "dp_replicate": 1, "dp_shard": dp, "tp": tp,
            "pp": 1, "cp": 1, "ep": 1}


def _log():
    """A job on dp4 that lost a node after step 5 (checkpoint of step 3: steps 4-5 ran again on tp2),
    resumed once more in that layout at step 9, and grew back to dp4 at step 12."""
    times = [9.0, 1.0, 1.0, *[0.5] * 9, 2.0, 1.0]
    records = [{"step": s, "loss": 5.0 - s / 10, "step_time_s": t, "tokens": 8, "tokens_per_s": 1.0}
               for s, t in zip(range(1, 15), times, strict=True)]
    events = [{"step": 0, "event": "start"}, _layout(0, 4),
              _layout(3, 2), {"step": 3, "event": "replan", "predicted_step_time_s": {"from": 0.1, "to": 0.2}},
              _layout(3, 1, tp=2), {"step": 3, "event": "replan", "predicted_step_time_s": {"from": 0.1, "to": 0.3}},
              _layout(9, 1, tp=2), _layout(12, 4)]
    return records, events


def test_each_layout_runs_from_the_step_after_its_event_to_the_next_one():
    records, events = _log()
    # At step 3 the later round wins (dp1 tp2, predicted 0.3); the resume at 9 continues its segment.
    # Medians: steps 1-3 (9, 1, 1) -> 1; 4-12 all 0.5; 13-14 (2, 1) -> 1.5.
    assert layout_segments(records, events) == [Segment(1, 3, "dp4", 4, 1.0, None),
                                                Segment(4, 12, "dp1 tp2", 2, 0.5, 0.3),
                                                Segment(13, 14, "dp4", 4, 1.5, None)]
    assert layout_segments(records, []) == [] and layout_segments([], events) == []


def test_the_report_shows_the_timeline_beside_the_loss(tmp_path):
    records, events = _log()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*events, *records]))
    page = build_report(tmp_path, progress=False)
    shown = dict(re.findall(r'id="(layout-[^"]+)" data-value="([^"]+)"', page))
    assert shown == {"layout-0-step-time": "1.0", "layout-1-step-time": "0.5", "layout-1-predicted": "0.3",
                     "layout-2-step-time": "1.5"}
    assert "<td>4-12</td><td>dp1 tp2</td><td>2</td>" in page
