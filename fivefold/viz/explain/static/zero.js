// ZeRO page: stacked bars of model state per GPU for each stage, against the GPU's memory.
"use strict";

const PARTS = [["params", "#4C72B0", "weights"], ["grads", "#DD8452", "gradients"],
               ["optimizer", "#8C6BB1", "optimizer state"]];

function drawBars(entry) {
  const svg = Explain.clear("bars");
  const left = 80, right = 190, top = 14, row = 56, width = 1040;
  const height = top + entry.stages.length * row + 36;
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const memory = entry.memory_bytes;
  const biggest = Math.max(...entry.stages.map(s => s.total));
  // Past 2.5x the GPU's memory a bar is cut (its total is written): the sharded stages stay readable.
  const xmax = biggest > 2.5 * memory ? 2.5 * memory : Math.max(biggest, memory) * 1.1;
  const scale = (width - left - right) / xmax;
  entry.stages.forEach((stage, k) => {
    const y = top + k * row;
    Explain.svg("text", { x: left - 10, y: y + row / 2, "text-anchor": "end", "font-size": 14,
      "font-weight": 600 }, svg).textContent = stage.name;
    let x = left;
    for (const [part, colour] of PARTS) {
      const w = Math.min(stage[part] * scale, left + xmax * scale - x);
      if (w > 0) Explain.svg("rect", { x, y: y + 10, width: w, height: row - 24, fill: colour }, svg);
      x += Math.max(w, 0);
    }
    const cut = stage.total > xmax;
    if (cut) {
      Explain.svg("path", { d: `M${x - 6},${y + 8} l6,${(row - 20) / 2} l-6,${(row - 20) / 2}`,
        stroke: "white", "stroke-width": 3, fill: "none" }, svg);
    }
    Explain.svg("text", { x: x + 8, y: y + row / 2 + 1, "font-size": 13,
      fill: stage.fits ? "#2e7d32" : "#c0392b" }, svg)
      .textContent = `${Explain.FORMATS.gb(stage.total)}, ${stage.fits ? "fits" : "does not fit"}`;
  });
  const mx = left + memory * scale, bottom = top + entry.stages.length * row;
  Explain.svg("line", { x1: mx, y1: top, x2: mx, y2: bottom, stroke: "#c0392b", "stroke-width": 2,
    "stroke-dasharray": "6 4" }, svg);
  Explain.svg("text", { x: mx, y: bottom + 16, "text-anchor": "middle", "font-size": 12, fill: "#c0392b" }, svg)
    .textContent = `GPU memory ${Explain.FORMATS.gb(memory)}`;
  Explain.svg("line", { x1: left, y1: bottom, x2: left + xmax * scale, y2: bottom, stroke: "#59636e" }, svg);
  Explain.svg("text", { x: left, y: bottom + 16, "text-anchor": "middle", "font-size": 12, fill: "#59636e" }, svg)
    .textContent = "0";
}

function drawTable(entry) {
  const table = Explain.clear("stages");
  const head = Explain.html("tr", {}, table);
  for (const h of ["stage", "weights", "gradients", "optimizer", "total per GPU", "fits", "largest model that fits"]) {
    Explain.html("th", {}, head, h);
  }
  entry.stages.forEach((stage, k) => {
    const row = Explain.html("tr", {}, table);
    Explain.html("th", {}, row, stage.name);
    for (const part of ["params", "grads", "optimizer", "total"]) {
      Explain.html("td", { id: `z${k}-${part}` }, row, Explain.FORMATS.gb(stage[part])).dataset.value =
        String(stage[part]);
    }
    const fits = Explain.html("td", { id: `z${k}-fits`, class: stage.fits ? "ok" : "mismatch" }, row,
      stage.fits ? "yes" : "no");
    fits.dataset.value = String(stage.fits);
    Explain.html("td", { id: `z${k}-largest` }, row, `${Explain.FORMATS.params(stage.largest_params)} params`)
      .dataset.value = String(stage.largest_params);
  });
}

function render(entry) {
  Explain.show("params", entry.params, "params");
  Explain.show("memory", entry.memory_bytes, "gb");
  drawBars(entry);
  drawTable(entry);
}
