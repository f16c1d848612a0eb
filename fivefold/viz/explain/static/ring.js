// Ring all-reduce page: the entry for n holds every state of the replayed schedule (ring.py);
// the step slider picks one.
"use strict";

Explain.FORMATS.frac = v => `${v.toFixed(3)} S`;

function drawRing(state, n) {
  const svg = Explain.clear("ring");
  const c = 150, radius = 105, node = 22;
  const at = r => {
    const angle = -Math.PI / 2 + (2 * Math.PI * r) / n;
    return [c + radius * Math.cos(angle), c + radius * Math.sin(angle)];
  };
  const defs = Explain.svg("defs", {}, svg);
  const marker = Explain.svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5,
    markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, defs);
  Explain.svg("path", { d: "M0,0 L10,5 L0,10 z", fill: "#4C72B0" }, marker);
  for (let r = 0; r < n; r++) {
    const [x1, y1] = at(r), [x2, y2] = at((r + 1) % n);
    const dx = x2 - x1, dy = y2 - y1, len = Math.hypot(dx, dy);
    const ux = dx / len, uy = dy / len;
    const active = state.sends.length > 0;
    Explain.svg("line", { x1: x1 + ux * node, y1: y1 + uy * node, x2: x2 - ux * (node + 2),
      y2: y2 - uy * (node + 2), stroke: active ? "#4C72B0" : "#c5ccd3", "stroke-width": active ? 2.5 : 1.5,
      "marker-end": active ? "url(#arrow)" : "" }, svg);
    if (active) {
      const send = state.sends[r];
      // The label sits outside the ring, beside the middle of its arrow.
      const mx = (x1 + x2) / 2, my = (y1 + y2) / 2;
      const ox = mx - c, oy = my - c, olen = Math.hypot(ox, oy) || 1;
      const t = Explain.svg("text", { x: mx + (ox / olen) * 22, y: my + (oy / olen) * 22 + 4,
        "text-anchor": "middle", "font-size": 12, fill: "#1f2328" }, svg);
      t.textContent = `c${send.chunk}: ${send.value}`;
    }
  }
  for (let r = 0; r < n; r++) {
    const [x, y] = at(r);
    Explain.svg("circle", { cx: x, cy: y, r: node, fill: "#f6f8fa", stroke: "#1f2328" }, svg);
    const t = Explain.svg("text", { x, y: y + 5, "text-anchor": "middle", "font-size": 14,
      "font-weight": 600 }, svg);
    t.textContent = `r${r}`;
  }
}

// "r0-r3, r6": the ranks whose contribution a chunk holds, consecutive ones as a range.
function ranksLabel(ranks, n) {
  if (ranks.length === n) return "all";
  const runs = [];
  for (const r of ranks) {
    const run = runs[runs.length - 1];
    if (run && r === run[1] + 1) run[1] = r; else runs.push([r, r]);
  }
  return runs.map(([a, b]) => (a === b ? `r${a}` : `r${a}\u2013r${b}`)).join(", ");
}

function drawTable(entry, state, last) {
  const n = entry.n;
  const table = Explain.clear("chunks");
  const head = Explain.html("tr", {}, table);
  Explain.html("th", {}, head, "");
  for (let c = 0; c < n; c++) Explain.html("th", {}, head, `chunk ${c}`);
  if (last) Explain.html("th", {}, head, "= direct sum?");
  for (let r = 0; r < n; r++) {
    const row = Explain.html("tr", {}, table);
    Explain.html("th", {}, row, `rank ${r}`);
    for (let c = 0; c < n; c++) {
      const cell = Explain.html("td", { id: `cell-${r}-${c}` }, row);
      cell.dataset.value = String(state.values[r][c]);
      const holds = state.ranks[r][c];
      const strong = Explain.html(holds.length === n ? "b" : "span", {}, cell, String(state.values[r][c]));
      strong.style.fontSize = "1.1em";
      Explain.html("div", {}, cell, ranksLabel(holds, n)).style.cssText =
        "font-size:0.72em;color:#59636e;white-space:nowrap";
      if (state.sends.length && state.sends[r].chunk === c) cell.style.background = "#c9daf8";
      if (state.received.length && state.received[r] === c) cell.style.background = "#fff3c4";
    }
    if (last) {
      Explain.html("td", { id: `match-${r}`, class: entry.matches[r] ? "ok" : "mismatch" }, row,
        entry.matches[r] ? "yes" : "NO");
    }
  }
  const sum = Explain.html("tr", {}, table);
  Explain.html("th", {}, sum, "direct sum");
  for (let c = 0; c < n; c++) {
    Explain.html("td", { id: `sum-${c}` }, sum, String(entry.direct_sum[c])).dataset.value =
      String(entry.direct_sum[c]);
  }
  if (last) Explain.html("td", {}, sum, "");
}

function render(entry) {
  const n = entry.n, states = entry.states;
  const el = document.querySelector('[data-control="step"]');
  const labels = states.map((s, k) => (k === 0 ? "start" : `${k} of ${states.length - 1}`));
  Explain.setSlider("step", states.map((s, k) => k), labels, Number(el.value));
  const k = Number(el.value);
  const state = states[k], last = k === states.length - 1;
  Explain.text("phase", k === 0 ? "start" : state.phase);
  Explain.show("sent", k, "int");
  Explain.show("sent-fraction", state.sent_fraction, "frac");
  Explain.show("wire-fraction", entry.wire_fraction, "frac");
  drawRing(state, n);
  drawTable(entry, state, last);
  const all = entry.matches.every(Boolean);
  const check = document.getElementById("check");
  check.className = last ? (all ? "ok" : "mismatch") : "";
  check.textContent = last
    ? (all ? `Every rank now holds the direct sum over its ${n} ranks.`
           : "A rank's result differs from the direct sum.")
    : `${states.length - 1 - k} step(s) to go; the check against the direct sum comes after the last one.`;
}
