// Pipeline page: draws the simulated timeline of the chosen (schedule, p, m, v) from its entry.
"use strict";

const KIND_RGB = { F: [76, 114, 176], B: [85, 168, 104], I: [221, 132, 82], W: [140, 107, 177] };

// Later chunks on a rank are lighter, as in `fivefold viz schedule`.
function shade(kind, chunk, v) {
  const amount = v > 1 ? (0.45 * chunk) / (v - 1) : 0;
  const [r, g, b] = KIND_RGB[kind].map(x => Math.round(x + (255 - x) * amount));
  return `rgb(${r},${g},${b})`;
}

function drawTimeline(entry) {
  const svg = Explain.clear("timeline");
  const p = entry.timeline.length, left = 62, right = 12, row = 30, top = 8;
  const width = 1040, height = top + p * row + 34;
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const scale = (width - left - right) / entry.makespan;
  entry.timeline.forEach((events, rank) => {
    const y = top + rank * row;
    Explain.svg("rect", { x: left, y: y + 2, width: width - left - right, height: row - 4, fill: "#f6f8fa" }, svg);
    Explain.svg("text", { x: left - 8, y: y + row / 2 + 5, "text-anchor": "end", "font-size": 13 }, svg)
      .textContent = `rank ${rank}`;
    for (const [start, end, kind, mb, chunk] of events) {
      const x = left + start * scale, w = (end - start) * scale;
      Explain.svg("rect", { x, y: y + 2, width: Math.max(w - 0.8, 0.5), height: row - 4,
        fill: shade(kind, chunk, entry.v) }, svg);
      const label = String(mb);
      if (w >= 7 * label.length + 6) {
        Explain.svg("text", { x: x + w / 2, y: y + row / 2 + 4, "text-anchor": "middle", "font-size": 11,
          fill: "white" }, svg).textContent = label;
      }
    }
  });
  const axisY = top + p * row + 4;
  Explain.svg("line", { x1: left, y1: axisY, x2: width - right, y2: axisY, stroke: "#59636e" }, svg);
  // Round ticks (1, 2 or 5 times a power of ten), at most about ten of them.
  const raw = entry.makespan / 10, power = 10 ** Math.floor(Math.log10(raw));
  const tick = [1, 2, 5, 10].map(f => f * power).find(t => t >= raw);
  for (let t = 0; t <= entry.makespan + 1e-9; t += tick) {
    const x = left + t * scale;
    Explain.svg("line", { x1: x, y1: axisY, x2: x, y2: axisY + 4, stroke: "#59636e" }, svg);
    Explain.svg("text", { x, y: axisY + 17, "text-anchor": "middle", "font-size": 11, fill: "#59636e" }, svg)
      .textContent = String(Number(t.toFixed(6)));
  }
  Explain.svg("text", { x: width - right, y: axisY + 30, "text-anchor": "end", "font-size": 11,
    fill: "#59636e" }, svg).textContent = "time (forward of one rank's layers = 1)";
}

function drawPerRank(entry) {
  const table = Explain.clear("per-rank");
  const head = Explain.html("tr", {}, table);
  for (const h of ["rank", "busy", "idle", "peak in flight"]) Explain.html("th", {}, head, h);
  entry.busy.forEach((busy, r) => {
    const row = Explain.html("tr", {}, table);
    Explain.html("th", {}, row, `rank ${r}`);
    for (const [name, v] of [["busy", busy], ["idle", entry.idle[r]], ["peak", entry.peak_inflight[r]]]) {
      const cell = Explain.html("td", { id: `${name}-${r}` }, row, Explain.FORMATS.num(v));
      cell.dataset.value = String(v);
    }
  });
}

function render(entry) {
  const kinds = new Set(entry.timeline.flat().map(event => event[2]));
  for (const item of document.querySelectorAll("[data-kind]")) {
    item.style.display = kinds.has(item.dataset.kind) ? "" : "none";
  }
  Explain.show("bubble-ratio", entry.bubble_ratio, "pct");
  Explain.show("bubble-fraction", entry.bubble_fraction, "pct");
  Explain.show("makespan", entry.makespan, "num");
  Explain.show("peak", Math.max(...entry.peak_inflight), "int");
  drawTimeline(entry);
  drawPerRank(entry);
}
