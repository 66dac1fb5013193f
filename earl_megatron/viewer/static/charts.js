// earl view's plots: small SVG charts drawn here (no library, nothing fetched).
// Each chart is a <div class="chart"> holding an <h3>, an <svg class="plot"> and a legend; an SVG
// carries data-points: how many finite points it drew (the browser test reads it).
"use strict";
const NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                 "#7f7f7f", "#bcbd22", "#17becf"];
const STAGE_COLOURS = {rollout: "#ff7f0e", logprob: "#2ca02c", train: "#9467bd",
                       "plan+switch": "#7f7f7f", switch: "#d62728", old_logprob: "#17becf",
                       weight_sync: "#8c564b"};

function el(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}

function html(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmt(v) {
  if (v === null || v === undefined || !isFinite(v)) return "";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(1);
  return String(Number(v.toPrecision(3)));
}

function finite(v) { return typeof v === "number" && isFinite(v); }

function frame(title, series) {
  const box = html("div", "chart");
  box.appendChild(html("h3", null, title));
  const legend = html("div", "legend");
  series.forEach((s, i) => {
    const item = html("span");
    const sw = html("i");
    sw.style.background = s.colour || PALETTE[i % PALETTE.length];
    item.appendChild(sw);
    item.appendChild(document.createTextNode(s.name));
    legend.appendChild(item);
  });
  return [box, legend];
}

// series: [{name, pts: [[x, y], ...], colour?, dashed?, markers?}]
function lineChart(title, series, opts) {
  opts = opts || {};
  const [box, legend] = frame(title, series);
  const pts = series.flatMap(s => s.pts.filter(p => finite(p[0]) && finite(p[1])));
  if (!pts.length) {
    box.classList.add("empty");
    box.appendChild(html("p", "note", "not recorded in this run"));
    return box;
  }
  const W = 380, H = 180, L = 48, R = 8, T = 8, B = 22;
  let [x0, x1] = [Math.min(...pts.map(p => p[0])), Math.max(...pts.map(p => p[0]))];
  let [y0, y1] = [Math.min(...pts.map(p => p[1])), Math.max(...pts.map(p => p[1]))];
  if (opts.y0 !== undefined) y0 = Math.min(y0, opts.y0);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, class: "plot", "data-points": pts.length});
  el("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#ccc"}, svg);
  for (let k = 0; k <= 4; k++) {
    const y = y0 + (y1 - y0) * k / 4;
    el("line", {x1: L, x2: W - R, y1: Y(y), y2: Y(y), stroke: "#eee"}, svg);
    el("text", {x: L - 4, y: Y(y) + 4, "text-anchor": "end", "font-size": 10}, svg)
      .textContent = fmt(y);
  }
  const step = Math.max(1, Math.ceil((x1 - x0) / 8));
  for (let x = Math.ceil(x0); x <= x1; x += step) {
    el("text", {x: X(x), y: H - 6, "text-anchor": "middle", "font-size": 10}, svg)
      .textContent = String(x);
  }
  series.forEach((s, i) => {
    const colour = s.colour || PALETTE[i % PALETTE.length];
    const good = s.pts.filter(p => finite(p[0]) && finite(p[1]));
    if (!s.markersOnly && good.length > 1) {
      el("polyline", {points: good.map(p => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`)
        .join(" "), fill: "none", stroke: colour, "stroke-width": 1.5,
        "stroke-dasharray": s.dashed ? "4 3" : "none", class: "series"}, svg);
    }
    if (s.markersOnly || good.length <= 60) {
      for (const p of good) {
        const c = el("circle", {cx: X(p[0]), cy: Y(p[1]), r: s.markersOnly ? 4 : 2.2,
                                fill: colour}, svg);
        el("title", {}, c).textContent = `${s.name}: ${fmt(p[1])} at ${p[0]}`;
      }
    }
  });
  box.appendChild(svg);
  box.appendChild(legend);
  return box;
}

// stacked bars: xs, keys, value(key, index) -> number
function stackedBars(title, xs, keys, value) {
  const series = keys.map(k => ({name: k, colour: STAGE_COLOURS[k], pts: []}));
  const [box, legend] = frame(title, series);
  const totals = xs.map((_, i) => keys.reduce((a, k) => a + (value(k, i) || 0), 0));
  if (!xs.length || !totals.some(t => t > 0)) {
    box.classList.add("empty");
    box.appendChild(html("p", "note", "not recorded in this run"));
    return box;
  }
  const W = 380, H = 180, L = 48, R = 8, T = 8, B = 22, top = Math.max(...totals);
  const bw = (W - L - R) / xs.length;
  const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, class: "plot", "data-points": xs.length});
  for (let k = 0; k <= 4; k++) {
    const y = T + (1 - k / 4) * (H - T - B);
    el("line", {x1: L, x2: W - R, y1: y, y2: y, stroke: "#eee"}, svg);
    el("text", {x: L - 4, y: y + 4, "text-anchor": "end", "font-size": 10}, svg)
      .textContent = fmt(top * k / 4);
  }
  xs.forEach((x, i) => {
    let y = H - B;
    keys.forEach((k, j) => {
      const h = (value(k, i) || 0) / top * (H - T - B);
      if (h <= 0) return;
      y -= h;
      const r = el("rect", {x: L + i * bw + bw * 0.1, y, width: Math.max(bw * 0.8, 0.5),
                            height: h, fill: series[j].colour || PALETTE[j % PALETTE.length]},
                   svg);
      el("title", {}, r).textContent = `${k}: ${fmt(value(k, i))} s at iteration ${x}`;
    });
    if (xs.length <= 20 || i % Math.ceil(xs.length / 10) === 0) {
      el("text", {x: L + (i + 0.5) * bw, y: H - 6, "text-anchor": "middle", "font-size": 10},
         svg).textContent = String(x);
    }
  });
  box.appendChild(svg);
  box.appendChild(legend);
  return box;
}

// the layout timeline: one row per stage, one cell per iteration, coloured by layout
function timeline(stages, rows, switches) {
  const its = [...new Set(rows.map(r => r.iteration))].sort((a, b) => a - b);
  const names = [...new Set(rows.map(r => r.layout))].sort();
  const cw = Math.max(6, Math.min(60, 1100 / Math.max(its.length, 1))), ch = 26, L = 90;
  const W = L + cw * its.length + 10, H = 20 + ch * stages.length + 24;
  const svg = el("svg", {width: W, height: H, class: "plot timeline", "data-points": rows.length});
  const col = {}, at = {};
  its.forEach((it, i) => { col[it] = i; });
  const switched = new Set(switches.map(s => `${s.stage}@${s.iteration}`));
  stages.forEach((s, j) => {
    at[s] = j;
    el("text", {x: 4, y: 20 + j * ch + 17, "font-size": 12, class: "stage-label"}, svg)
      .textContent = s;
  });
  for (const r of rows) {
    const x = L + col[r.iteration] * cw, y = 20 + at[r.stage] * ch;
    const sw = switched.has(`${r.stage}@${r.iteration}`);
    const cell = el("rect", {x, y, width: cw - 1, height: ch - 2,
                             fill: PALETTE[names.indexOf(r.layout) % PALETTE.length],
                             "fill-opacity": 0.55, stroke: sw ? "#000" : "none",
                             "stroke-width": sw ? 2.5 : 0, class: "cell"}, svg);
    const lines = [`${r.stage}, iteration ${r.iteration}: ${r.layout}`];
    if (r.recompute) lines.push(`recompute: ${r.recompute}`);
    if (finite(r.predicted_memory_gb)) lines.push(`predicted memory ${fmt(r.predicted_memory_gb)} GB`);
    if (finite(r.measured_memory_gb)) lines.push(`measured memory ${fmt(r.measured_memory_gb)} GB`);
    if (finite(r.predicted_seconds)) lines.push(`predicted ${fmt(r.predicted_seconds)} s`);
    if (finite(r.seconds)) lines.push(`measured ${fmt(r.seconds)} s`);
    if (r.reason) lines.push(`why: ${r.reason}`);
    el("title", {}, cell).textContent = lines.join("\n");
    if (cw >= 36) {
      el("text", {x: x + 3, y: y + 16, "font-size": 10, "pointer-events": "none"}, svg)
        .textContent = r.layout;
    }
  }
  const step = Math.max(1, Math.ceil(its.length / 20));
  its.forEach((it, i) => {
    if (i % step === 0) {
      el("text", {x: L + i * cw + cw / 2, y: 14, "font-size": 10, "text-anchor": "middle"}, svg)
        .textContent = String(it);
    }
  });
  const key = html("div", "legend");
  names.forEach((n, i) => {
    const item = html("span"), sw = html("i");
    sw.style.background = PALETTE[i % PALETTE.length];
    sw.style.height = "10px";
    item.appendChild(sw);
    item.appendChild(document.createTextNode(n));
    key.appendChild(item);
  });
  const box = html("div");
  box.appendChild(svg);
  box.appendChild(key);
  return box;
}
