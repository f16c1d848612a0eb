// Gradient bucket page: the backward and the bucketed all-reduce on one time axis.
"use strict";

const MAX_STRIPES = 40;  // more buckets than this are drawn as one block, with their count

function drawOverlap(entry) {
  const svg = Explain.clear("overlap");
  const left = 110, right = 20, width = 1040, lane = 34, top = 26;
  const end = entry.last[1], height = top + 2 * lane + 56;
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const span = Math.max(end, entry.window_s) * 1.04;
  const scale = (width - left - right) / span;
  const X = t => left + t * scale;
  const lanes = [["backward", top], ["all-reduce", top + lane + 8]];
  for (const [name, y] of lanes) {
    Explain.svg("text", { x: left - 10, y: y + lane / 2 + 5, "text-anchor": "end", "font-size": 13 }, svg)
      .textContent = name;
  }
  Explain.svg("rect", { x: X(0), y: top, width: entry.window_s * scale, height: lane, fill: "#55A868" }, svg);
  const y = top + lane + 8;
  const [s0, s1, count] = entry.earlier;
  if (count > MAX_STRIPES) {
    Explain.svg("rect", { x: X(s0), y, width: (s1 - s0) * scale, height: lane, fill: "#4C72B0" }, svg);
    Explain.svg("text", { x: X((s0 + s1) / 2), y: y + lane / 2 + 5, "text-anchor": "middle", "font-size": 12,
      fill: "white" }, svg).textContent = `${count.toLocaleString("en-US")} buckets`;
  } else {
    for (let k = 0; k < count; k++) {
      const a = s0 + ((s1 - s0) * k) / count;
      Explain.svg("rect", { x: X(a), y, width: Math.max(((s1 - s0) / count) * scale - 1, 0.5), height: lane,
        fill: k % 2 ? "#6f8fc4" : "#4C72B0" }, svg);
    }
  }
  Explain.svg("rect", { x: X(entry.last[0]), y, width: Math.max((entry.last[1] - entry.last[0]) * scale, 1),
    height: lane, fill: "#DD8452" }, svg);
  if (end > entry.window_s) {
    Explain.svg("rect", { x: X(entry.window_s), y: top - 4, width: (end - entry.window_s) * scale,
      height: 2 * lane + 16, fill: "rgba(192,57,43,0.12)", stroke: "#c0392b", "stroke-dasharray": "4 3" }, svg);
  }
  // The exposed time is often a sliver: name it beside the end of the reduction.
  const room = X(end) + 150 < width;
  Explain.svg("text", { x: X(end) + (room ? 6 : -6), y: top - 10, "text-anchor": room ? "start" : "end",
    "font-size": 12, fill: "#c0392b" }, svg).textContent = `exposed ${Explain.FORMATS.ms(entry.exposed_s)}`;
  const axisY = top + 2 * lane + 20;
  Explain.svg("line", { x1: left, y1: axisY, x2: width - right, y2: axisY, stroke: "#59636e" }, svg);
  for (let k = 0; k <= 8; k++) {
    const t = (span * k) / 8;
    Explain.svg("line", { x1: X(t), y1: axisY, x2: X(t), y2: axisY + 4, stroke: "#59636e" }, svg);
    Explain.svg("text", { x: X(t), y: axisY + 17, "text-anchor": "middle", "font-size": 11, fill: "#59636e" }, svg)
      .textContent = k === 0 ? "0" : `${(t * 1e3).toFixed(span * 1e3 < 80 ? 1 : 0)} ms`;
  }
  Explain.svg("text", { x: width - right, y: axisY + 32, "text-anchor": "end", "font-size": 11, fill: "#59636e" },
    svg).textContent = "orange: the last bucket; red box: exposed time the step waits for";
}

function render(entry) {
  Explain.show("exposed", entry.exposed_s, "ms");
  Explain.show("window", entry.window_s, "ms");
  Explain.show("reduce", entry.reduce_s, "ms");
  Explain.show("bucket", entry.bucket_s, "ms");
  Explain.show("grads", entry.grad_bytes, "gb");
  Explain.show("buckets", entry.buckets, "int");
  Explain.text("link", entry.inter_node
    ? "These ranks span nodes: the all-reduce runs over the network (NIC), far slower than NVLink."
    : "These ranks share one node: the all-reduce runs over NVLink.");
  drawOverlap(entry);
}
