// Shared by every explainer page: read the controls, look the entry up, show numbers, draw SVG.
// Nothing here computes a model quantity: the numbers are in the page's JSON table (page.py).
"use strict";

const Explain = (() => {
  const DATA = JSON.parse(document.getElementById("data").textContent);
  const SVG_NS = "http://www.w3.org/2000/svg";

  function control(name) {
    return document.querySelector(`[data-control="${name}"]`);
  }

  // The chosen value of a control: a select's value, or a slider's value at its position.
  function value(name) {
    const el = control(name);
    if (el.type === "range") return JSON.parse(el.dataset.values)[Number(el.value)];
    return el.value;
  }

  function key() {
    return DATA.controls.filter(c => c.keyed).map(c => `${c.name}=${value(c.name)}`).join("|");
  }

  // A slider's positions can change with another control (the ring's steps with n).
  function setSlider(name, values, labels, position) {
    const el = control(name);
    el.dataset.values = JSON.stringify(values);
    el.dataset.labels = JSON.stringify(labels);
    el.max = String(values.length - 1);
    el.value = String(Math.min(position, values.length - 1));
    syncOutput(el);
  }

  function syncOutput(el) {
    if (el.type !== "range") return;
    const out = document.getElementById(`out-${el.dataset.control}`);
    out.textContent = JSON.parse(el.dataset.labels)[Number(el.value)];
  }

  const FORMATS = {
    gb: v => `${(v / 1e9).toFixed(2)} GB`,
    ms: v => `${(v * 1e3).toFixed(2)} ms`,
    pct: v => `${(v * 100).toFixed(2)} %`,
    int: v => Math.round(v).toLocaleString("en-US"),
    num: v => String(Number(v.toPrecision(6))),
    params: v => `${(v / 1e9).toFixed(2)} B`,
  };

  // Shows a number: the text is rounded for reading, data-value keeps it exact for the tests.
  function show(id, v, format) {
    const el = document.getElementById(id);
    el.dataset.value = String(v);
    el.textContent = FORMATS[format](v);
    return el;
  }

  function text(id, s) {
    document.getElementById(id).textContent = s;
  }

  function svg(tag, attrs, parent) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
    if (parent) parent.appendChild(el);
    return el;
  }

  function html(tag, attrs, parent, content) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
    if (content !== undefined) el.textContent = content;
    if (parent) parent.appendChild(el);
    return el;
  }

  function clear(id) {
    const el = document.getElementById(id);
    while (el.firstChild) el.removeChild(el.firstChild);
    return el;
  }

  // Calls render(entry) now and after every change of a control.
  function start(render) {
    let shown = null;
    const update = () => {
      // A select fires both events for one choice: draw once per distinct position.
      const position = DATA.controls.map(c => `${c.name}=${control(c.name).value}`).join("|");
      if (position === shown) return;
      shown = position;
      const entry = DATA.table[key()];
      const error = document.getElementById("error");
      const page = document.getElementById("page");
      if (entry.error) {
        error.textContent = entry.error;
        page.classList.add("invalid");
        return;
      }
      error.textContent = "";
      page.classList.remove("invalid");
      render(entry);
    };
    // Both events: a select may fire only "change" (as WebDriver's does), a slider "input" while dragged.
    for (const el of document.querySelectorAll("[data-control]")) {
      for (const type of ["input", "change"]) el.addEventListener(type, () => { syncOutput(el); update(); });
    }
    update();
  }

  return { setSlider, show, text, svg, html, clear, start, FORMATS };
})();
