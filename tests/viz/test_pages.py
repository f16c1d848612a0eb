"""The explainer pages and the run report, in a real headless Chromium.

Each page must load from file:// with no console error and no fetch, and at three or more
positions of each control the numbers in its DOM must equal what fivefold's Python computes for
them (data-value holds the exact number; the text is checked to its display rounding). One
browser serves every page. Debian's chromium and chromium-driver are installed by
scripts/install-browser.sh (`make test` runs it); without them these tests fail, they do not skip.
FIVEFOLD_PAGE_SHOTS=DIR keeps one screenshot per page in DIR, to look at.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from helpers import ROOT

from fivefold.cli import main
from fivefold.model.counts import model_counts
from fivefold.model.presets import PRESETS
from fivefold.parallel.comm.collectives import wire_bytes
from fivefold.parallel.pipeline.schedules import build_schedule
from fivefold.parallel.pipeline.simulate import Costs, simulate
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware
from fivefold.planner.memory import BytesPerParam, largest_fitting_model, model_state_bytes
from fivefold.viz.explain import buckets, ring
from fivefold.viz.schedule import per_chunk_costs

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# Headless, and nothing that reaches for the network (this machine has none: each would stall).
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
         "--window-size=1200,900")


INSTALL_LOG, INSTALL_DONE = ROOT / ".browser-install.log", ROOT / ".browser-install.done"


def _wait_for_install(timeout_s: float = 600.0) -> None:
    """`make test` installs the browser in the background (Makefile `browser`): wait for it."""
    deadline = time.monotonic() + timeout_s
    while INSTALL_LOG.exists() and not INSTALL_DONE.exists() and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    _wait_for_install()
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        log = INSTALL_LOG.read_text()[-2000:] if INSTALL_LOG.exists() else ""
        pytest.fail(f"{', '.join(missing)} not found: run `bash scripts/install-browser.sh` as root "
                    f"(apt-get install chromium chromium-driver); `make test` does it\n{log}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)  # no Selenium Manager
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("explain")
    assert main(["explain", "--out", str(out), "--no-progress"]) == 0
    return out


def open_page(driver, path: Path, shot: str = "") -> None:
    """Load a page; fail on any console message of level SEVERE or on any fetch beyond the file."""
    driver.get(path.as_uri())
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"{path.name}: console errors {errors}"
    fetched = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name).filter(n => !n.startsWith('data:'))")
    assert not fetched, f"{path.name} fetched {fetched}"
    shots = os.environ.get("FIVEFOLD_PAGE_SHOTS")
    if shots:
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1200, min(height + 140, 4000))
        Path(shots).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(shots) / f"{shot or path.stem}.png"))
        driver.set_window_size(1200, 900)


def set_controls(driver, **values) -> None:
    """Move controls to these values (a select's option, a slider's position) and fire the events a
    user's choice fires, all in one round trip; then check the console stayed clean."""
    driver.execute_script("""
        for (const [name, value] of Object.entries(arguments[0])) {
          const el = document.querySelector(`[data-control="${name}"]`);
          if (el.type === "range") {
            const position = JSON.parse(el.dataset.values).indexOf(value);
            if (position < 0) throw new Error(`${name} has no position ${value}`);
            el.value = String(position);
            el.dispatchEvent(new Event("input"));
          } else {
            if (![...el.options].some(o => o.value === String(value))) throw new Error(`${name}: no ${value}`);
            el.value = String(value);
            el.dispatchEvent(new Event("change"));
          }
        }""", values)
    assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def numbers(driver) -> dict[str, tuple[float, str]]:
    """Every element with an id and a data-value: (exact value, shown text)."""
    found = driver.execute_script(
        "return Array.from(document.querySelectorAll('[id][data-value]'))"
        ".map(e => [e.id, e.dataset.value, e.textContent])")
    return {i: (json.loads(v), text) for i, v, text in found}


def check(shown: dict, ident: str, expected: float, unit: float = 1.0, places: int | None = None) -> None:
    value, text = shown[ident]
    assert value == pytest.approx(expected, rel=1e-12, abs=1e-15), ident
    if places is not None:  # the text, to the rounding it is shown with
        number = float(re.search(r"-?[\d,]*\.?\d+", text).group().replace(",", ""))
        assert number == pytest.approx(expected / unit, abs=0.51 * 10 ** -places), (ident, text)


def test_index_links_every_page(browser, pages):
    from selenium.webdriver.common.by import By

    open_page(browser, pages / "index.html")
    links = {a.get_attribute("href").rsplit("/", 1)[-1] for a in browser.find_elements(By.TAG_NAME, "a")}
    assert links == {p.name for p in pages.glob("*.html")} - {"index.html"}


def test_ring_allreduce_page(browser, pages):
    open_page(browser, pages / "ring_allreduce.html")
    for n in (2, 4, 8):
        set_controls(browser, n=n)
        states = ring.replay(n)
        total = [sum(ring.start_value(r, c) for r in range(n)) for c in range(n)]  # the direct sum
        for step in (0, n - 1, 2 * (n - 1)):  # start, end of reduce-scatter, the last step
            set_controls(browser, step=step)
            shown = numbers(browser)
            for r in range(n):
                for c in range(n):
                    check(shown, f"cell-{r}-{c}", states[step]["values"][r][c], places=0)
            check(shown, "sent", step, places=0)
            check(shown, "sent-fraction", step / n, places=3)
            check(shown, "wire-fraction", wire_bytes("all_reduce", 1, n), places=3)
            if step == n - 1:  # reduce-scatter's layout: rank r holds chunk r summed
                assert [states[step]["values"][r][r] for r in range(n)] == total
        for r in range(n):
            assert [shown[f"cell-{r}-{c}"][0] for c in range(n)] == total
            assert browser.find_element("id", f"match-{r}").text == "yes"
        assert "direct sum" in browser.find_element("id", "check").text


def test_gradient_buckets_page(browser, pages):
    open_page(browser, pages / "gradient_buckets.html")
    hw = get_hardware(buckets.GPU)
    for bucket, tokens, n in [(1, 1024, 8), (25, 4096, 8), (1600, 32768, 8), (25, 1024, 2), (25, 1024, 16),
                              (400, 8192, 64), (1600, 1024, 2)]:
        set_controls(browser, bucket=bucket, tokens=tokens, n=n)
        est = estimate(buckets.config(bucket, tokens, n), n, hw)
        shown = numbers(browser)
        check(shown, "exposed", est.exposed_dp_s, 1e-3, 2)
        check(shown, "window", est.dp_overlap.window_s, 1e-3, 2)
        check(shown, "reduce", est.dp_overlap.reduce_s, 1e-3, 2)
        check(shown, "bucket", est.dp_overlap.bucket_s, 1e-3, 2)
        assert est.exposed_dp_s == pytest.approx(est.dp_overlap.exposed_s)  # DDP: nothing else is exposed


def test_pipeline_page(browser, pages):
    open_page(browser, pages / "pipeline_schedules.html")
    positions = [("1f1b", 2, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 16, 1), ("1f1b", 4, 1, 1), ("1f1b", 4, 4, 1),
                 ("gpipe", 4, 8, 1), ("zb_h1", 4, 8, 1), ("zb_v", 4, 8, 2), ("dualpipe_v", 4, 8, 1),
                 ("interleaved_1f1b", 2, 8, 2), ("interleaved_1f1b", 2, 8, 3), ("interleaved_1f1b", 4, 16, 4)]
    for schedule, p, m, v in positions:
        set_controls(browser, schedule=schedule, p=p, m=m, v=v)
        s = build_schedule(schedule, p, m, v)
        result = simulate(s, per_chunk_costs(Costs(f=1.0, b=2.0), s.virtual_stages))
        shown = numbers(browser)
        check(shown, "bubble-ratio", result.bubble_ratio, 1e-2, 2)
        check(shown, "bubble-fraction", result.bubble_fraction, 1e-2, 2)
        check(shown, "makespan", result.makespan)
        check(shown, "peak", max(result.peak_inflight), places=0)
        for r in range(p):
            check(shown, f"busy-{r}", result.busy[r])
            check(shown, f"idle-{r}", result.idle[r])
            check(shown, f"peak-{r}", result.peak_inflight[r])
    set_controls(browser, schedule="gpipe", v=3)  # refused by build_schedule: its message is shown
    with pytest.raises(ValueError) as refused:
        build_schedule("gpipe", 4, 16, 3)
    assert browser.find_element("id", "error").text == str(refused.value)
    assert not browser.find_element("id", "page").is_displayed()


def test_zero_memory_page(browser, pages):
    open_page(browser, pages / "zero_memory.html")
    b = BytesPerParam()
    for model, n, gpu in [("llama3-8b", 1, "h100"), ("llama3-8b", 64, "a100-40gb"), ("llama3-70b", 8, "mi300x"),
                          ("deepseek-v3", 1024, "h100"), ("mixtral-8x7b", 16, "b200")]:
        set_controls(browser, model=model, n=n, gpu=gpu)
        params = model_counts(PRESETS[model]).total
        memory = get_hardware(gpu).memory_bytes
        shown = numbers(browser)
        check(shown, "params", params, 1e9, 2)
        for zero in range(4):
            state = model_state_bytes(params, b, zero, n)
            for part in ("params", "grads", "optimizer", "total"):
                check(shown, f"z{zero}-{part}", state[part], 1e9, 2)
            assert shown[f"z{zero}-fits"][0] == (state["total"] <= memory)
            check(shown, f"z{zero}-largest", largest_fitting_model(memory, b, zero, n), 1e9, 2)


def _run_dir(tmp: Path, with_optional: bool) -> Path:
    """A run directory as `fivefold train` writes it (keys of train/metrics.py), 6 steps."""
    run = tmp / ("full" if with_optional else "plain")
    run.mkdir()
    (run / "config.toml").write_text('[model]\npreset = "debug"\ndim = 128\n[parallel]\ndp = 2\npp = 2\n'
                                     'pp_schedule = "1f1b"\nvirtual_stages = 1\n[run]\nname = "demo"\n')
    state = {"params": 1.5e6, "grads": 1.5e6, "optimizer": 3e6, "total": 6e6}
    predicted = {"model_state_bytes": {**state, "total": 6e6}, "activation_bytes": 2e7, "buffer_bytes": 1e6,
                 "peak_bytes": 2.7e7, "comm_wire_bytes": {"dp": 1.5e6, "tp": 0.0, "pp": 4e5, "cp": 0.0, "ep": 0.0},
                 "step_time_s": 0.25}
    lines = []
    for step in range(1, 7):
        record = {"step": step, "epoch": 0, "loss": 6.0 - 0.5 * step, "lr": 1e-3, "grad_norm": 1.0, "tokens": 2048,
                  "step_time_s": 0.2, "tokens_per_s": 1000.0 * step,
                  "comm": {"dp": {"calls": 1, "bytes": 1.5e6, "wire_bytes": 1.5e6},
                           "pp": {"calls": 8, "bytes": 4e5, "wire_bytes": 4e5}},
                  "model_state_bytes": state if step > 1 else {**state, "optimizer": 0, "total": 3e6},
                  "predicted": predicted}
        if step % 3 == 0:
            record["val_loss"] = 5.0 - 0.1 * step
        if with_optional:
            record["step_breakdown"] = {"compute": 0.15, "bubble": 0.03, "optimizer": 0.02}
            record["pipeline_timeline"] = [[[0.0, 0.01, "F0s0"], [0.03, 0.05, "B0s0"]],
                                           [[0.01, 0.02, "F0s1"], [0.02, 0.03, "B0s1"]]]
            if step % 2 == 0:  # logging steps (train.log_every = 2)
                record["utilization"] = {"achieved_tflops": 100.0 * step, "hardware_tflops": 120.0 * step,
                                         "mfu": 0.1 * step, "hfu": 0.12 * step, "peak_tflops": 1000.0,
                                         "peak_from": "setting"}
                record["memory"] = {"peak_allocated_bytes": 3e7 + step, "peak_reserved_bytes": 4e7,
                                    "alloc_retries": 1}
        lines.append(json.dumps(record))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


@pytest.mark.parametrize("with_optional", [True, False], ids=["all-sections", "log-without-optional-keys"])
def test_run_report(browser, tmp_path, with_optional):
    run = _run_dir(tmp_path, with_optional)
    assert main(["report", str(run), "--no-progress"]) == 0
    open_page(browser, run / "report.html", f"report-{run.name}")
    shown = numbers(browser)
    check(shown, "steps", 6, places=0)
    check(shown, "last-loss", 3.0, places=4)
    check(shown, "last-val", 4.4, places=4)
    check(shown, "median-tps", 4000.0, places=0)  # steps 2..6
    check(shown, "mem-optimizer", 3e6)  # the largest sample, not step 1's
    check(shown, "pred-total", 6e6)
    check(shown, "comm-pp", 4e5)
    check(shown, "pred-comm-dp", 1.5e6)
    images = browser.execute_script("return Array.from(document.images).map(i => i.complete && i.naturalWidth > 0)")
    assert images and all(images)  # every figure decoded
    text = browser.find_element("tag name", "body").text
    assert ("Not in this run's metrics log: step_breakdown" in text) != with_optional
    assert ("Not in this run's metrics log: pipeline_timeline" in text) != with_optional
    assert ("Not in this run's metrics log: utilization" in text) != with_optional
    if with_optional:
        check(shown, "part-bubble", 0.03, 1e-3, 2)
        check(shown, "util-tflops", 400.0, places=0)  # the median of steps 2, 4, 6
        check(shown, "util-mfu", 0.4, 1e-2, 2)
        check(shown, "util-hfu", 0.48, 1e-2, 2)
        check(shown, "util-step-time-pred", 0.25, places=2)
        check(shown, "util-peak-memory", 3e7 + 6)  # the largest window's
        check(shown, "util-peak-memory-pred", 2.7e7)
        assert "Allocation retries (CUDA): 3" in text
        assert len(images) == 7
