// earl view's page: three views over the JSON API of earl_megatron/viewer/server.py.
// The run view polls /api/run with the number of records it holds, so a live run costs one
// new line per poll; the episodes view asks for one page of summaries at a time and one
// sample when chosen, so thousands of samples never reach the page at once.
"use strict";
const POLL_MS = 2000, PAGE = 50;
const state = {records: [], evals: {}, info: {}, offset: 0, chosen: null, layoutsAt: -1,
               samplesAt: -1, filterKey: ""};

async function get(url) {
  const r = await fetch(url, {cache: "no-store"});
  if (!r.ok) throw new Error(`${url}: ${r.status} ${await r.text()}`);
  return r.json();
}

function show(view) {
  for (const s of document.querySelectorAll(".view")) s.classList.toggle("active", s.id === `view-${view}`);
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === view);
  if (view === "layouts") refreshLayouts(true);
  if (view === "episodes") refreshSamples(true);
}

function route() {
  const [view, key] = (location.hash.slice(1) || "run").split("/");
  show(["run", "layouts", "episodes"].includes(view) ? view : "run");
  if (view === "episodes" && key) openSample(decodeURIComponent(key));
}

// ---------------------------------------------------------------- the run
function evalX(when) {
  if (when === "start") return -1;
  if (when === "end") return state.records.length ? state.records[state.records.length - 1].iteration : 0;
  const m = /^iter(\d+)$/.exec(when);
  return m ? Number(m[1]) - 1 : null;
}

function series(name, key, extra) {
  return Object.assign({name, pts: state.records.map(r => [r.iteration, typeof key === "function" ? key(r) : r[key]])}, extra || {});
}

function evalSeries(score) {
  const names = new Set();
  for (const res of Object.values(state.evals)) for (const n in res || {}) names.add(n);
  return [...names].sort().map(n => ({name: `eval ${n}`, markersOnly: true,
    pts: Object.entries(state.evals).filter(([w, res]) => res && res[n] && evalX(w) !== null)
      .map(([w, res]) => [evalX(w), res[n][score] ?? res[n].win_rate ?? res[n].accuracy])}));
}

function renderRun() {
  const box = document.getElementById("run-charts");
  const rs = state.records, tool = rs.some(r => "accuracy" in r);
  const score = tool ? "accuracy" : "win_rate";
  const last = rs[rs.length - 1];
  document.getElementById("run-summary").textContent = rs.length
    ? `${rs.length} iterations recorded` + (state.info.iterations ? ` of ${state.info.iterations}` : "")
      + ` · environment ${state.info.env ?? "?"} · algorithm ${state.info.algorithm ?? "?"}`
      + ` · last: iteration ${last.iteration}, reward ${fmt(last.reward)}`
    : "no iterations recorded yet (the page updates as the run writes metrics.jsonl)";
  const stages = [...new Set(rs.flatMap(r => Object.keys(r.seconds || {})))].filter(k => k !== "total");
  const order = ["plan+switch", "rollout", "old_logprob", "logprob", "switch", "train", "weight_sync"];
  stages.sort((a, b) => (order.indexOf(a) + 1 || 99) - (order.indexOf(b) + 1 || 99));
  const charts = [
    lineChart("reward", [series("mean reward", "reward"),
      series("illegal + unparsable", r => (r.illegal_rate ?? NaN) + (r.unparsable_rate ?? NaN))]),
    lineChart(tool ? "accuracy and tool use (evaluations as markers)" : "win rate (evaluations as markers)",
      [series(tool ? "accuracy (sampled)" : "win rate (sampled)", score),
       ...(tool ? [series("tool calls / episode", "tool_calls"), series("tool errors", "tool_error_rate")] : []),
       ...evalSeries(score)], {y0: 0}),
    lineChart("loss", [series("loss", "loss")]),
    lineChart("KL to the reference", [series("kl", "kl"), series("max |log ratio|", "ref_log_ratio_max", {dashed: true})]),
    lineChart("entropy", [series("entropy", "entropy")]),
    lineChart("clip fraction and ratio", [series("clip fraction", "clip_fraction"), series("ratio mean", "ratio_mean", {dashed: true})]),
    lineChart("staleness (policy versions behind)", [series("mean", "staleness_mean"), series("max", "staleness_max")], {y0: 0}),
    stackedBars("seconds per stage (stacked)", rs.map(r => r.iteration), stages, (k, i) => (rs[i].seconds || {})[k]),
    lineChart("context length (tokens)", [series("mean", "mean_context"), series("max", "max_context")]),
    lineChart("grad norm", [series("grad norm", "grad_norm")]),
  ];
  box.replaceChildren(...charts);
}

async function pollRun() {
  try {
    const got = await get(`/api/run?since=${state.records.length}`);
    if (got.total < state.records.length) state.records = [];   // rewritten (a resume)
    state.records = state.records.slice(0, got.since).concat(got.records);
    const changed = got.records.length > 0 || JSON.stringify(got.evals) !== JSON.stringify(state.evals);
    state.evals = got.evals;
    state.info = got;
    document.getElementById("runpath").textContent = got.path;
    document.getElementById("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
    if (changed || !document.getElementById("run-charts").children.length) renderRun();
    if (changed) { refreshLayouts(false); refreshSamples(false); }
  } catch (e) {
    document.getElementById("status").textContent = `cannot reach the server (${e.message})`;
  }
  setTimeout(pollRun, POLL_MS);
}

// ---------------------------------------------------------------- the layouts
async function refreshLayouts(force) {
  if (!document.getElementById("view-layouts").classList.contains("active")) return;
  if (!force && state.layoutsAt === state.records.length) return;
  state.layoutsAt = state.records.length;
  const v = await get("/api/layouts");
  const tl = document.getElementById("timeline");
  tl.replaceChildren(v.rows.length ? timeline(v.stages, v.rows, v.switches)
                                   : html("p", "note", "no layouts recorded yet"));
  const sw = document.getElementById("switches");
  if (!v.switches.length) sw.replaceChildren(html("p", "note", "no stage switched layout"));
  else {
    const t = html("table");
    t.innerHTML = "<tr><th>iteration</th><th>stage</th><th>from</th><th>to</th><th>the selector's reason</th></tr>";
    for (const s of v.switches) {
      const tr = html("tr");
      for (const c of [s.iteration, s.stage, s.from, s.to, s.reason || "(not recorded)"]) tr.appendChild(html("td", null, String(c)));
      t.appendChild(tr);
    }
    sw.replaceChildren(t);
  }
  const per = (stage, key) => v.rows.filter(r => r.stage === stage).map(r => [r.iteration, r[key]]);
  const charts = [];
  for (const s of v.stages) {
    charts.push(lineChart(`${s}: predicted against measured memory (GB)`, [
      {name: "predicted", pts: per(s, "predicted_memory_gb")},
      {name: "measured", pts: per(s, "measured_memory_gb"), dashed: true}], {y0: 0}));
    charts.push(lineChart(`${s}: predicted against measured seconds`, [
      {name: "predicted", pts: per(s, "predicted_seconds")},
      {name: "measured", pts: per(s, "seconds"), dashed: true}], {y0: 0}));
  }
  charts.push(lineChart("context length per iteration (tokens)", [
    {name: "mean", pts: v.context.map(c => [c.iteration, c.mean])},
    {name: "max", pts: v.context.map(c => [c.iteration, c.max])}]));
  const hist = v.histogram;
  charts.push(stackedBars("context length distribution (written samples, tokens)",
    hist.map(b => `${b.lo}`), ["samples"], (k, i) => hist[i].count));
  document.getElementById("layout-charts").replaceChildren(...charts);
  const sp = document.getElementById("split-plans");
  sp.replaceChildren(...(v.split_plans.length ? [html("h2", null, "placement plans (split pools)"),
    ...v.split_plans.slice(-10).map(p => html("p", "note", `iteration ${p.iteration}: ${p.plan}`))] : []));
}

// ---------------------------------------------------------------- the episodes
function filters() {
  const f = new FormData(document.getElementById("filters")), q = new URLSearchParams();
  for (const [k, v] of f.entries()) if (String(v).trim() !== "") q.set(k, String(v).trim());
  return q;
}

function fillSelect(name, values) {
  const sel = document.querySelector(`#filters [name=${name}]`), keep = sel.value;
  const want = ["", ...values.map(String)];
  if ([...sel.options].map(o => o.value).join("|") === want.join("|")) return;
  sel.replaceChildren(...want.map(v => { const o = html("option", null, v || "all"); o.value = v; return o; }));
  sel.value = want.includes(keep) ? keep : "";
}

async function refreshSamples(force) {
  if (!document.getElementById("view-episodes").classList.contains("active")) return;
  const q = filters();
  if (q.toString() !== state.filterKey) { state.offset = 0; state.filterKey = q.toString(); }
  if (!force && state.samplesAt === state.records.length) return;
  state.samplesAt = state.records.length;
  q.set("offset", state.offset); q.set("limit", PAGE);
  const page = await get(`/api/samples?${q}`);
  fillSelect("iteration", page.facets.iterations);
  fillSelect("env", page.facets.envs);
  fillSelect("finish", page.facets.finish_reasons);
  document.getElementById("count").textContent = page.all
    ? `${page.total ? state.offset + 1 : 0}-${Math.min(state.offset + PAGE, page.total)} of ${page.total} (of ${page.all} written)`
    : "no samples written (run.samples_per_iteration=0, or none yet)";
  state.total = page.total;
  const t = html("table");
  t.innerHTML = "<tr><th>iter</th><th>sample</th><th>env</th><th>reward</th><th>finish</th><th>turns</th></tr>";
  for (const r of page.rows) {
    const tr = html("tr");
    tr.dataset.key = r.key;
    if (r.key === state.chosen) tr.classList.add("chosen");
    const rep = r.replica === null ? "" : ` r${r.replica}`;
    for (const c of [r.iteration, `${r.sample}${rep}${r.fork ? ` fork ${r.fork}` : ""}`, r.env, fmt(r.reward), r.finish_reason, r.turns]) tr.appendChild(html("td", null, String(c ?? "")));
    tr.onclick = () => { location.hash = `episodes/${encodeURIComponent(r.key)}`; };
    t.appendChild(tr);
  }
  document.getElementById("sample-list").replaceChildren(t);
}

async function openSample(key) {
  state.chosen = key;
  for (const tr of document.querySelectorAll("#sample-list tr")) tr.classList.toggle("chosen", tr.dataset.key === key);
  const s = await get(`/api/sample?key=${encodeURIComponent(key)}`);
  const box = document.getElementById("sample-detail");
  const head = html("div");
  const info = s.info || {};
  const flags = ["unparsable", "illegal", "tool_error", "malformed_call", "tool_budget", "agent_error", "agent_timeout"].filter(k => info[k]);
  head.appendChild(html("h2", null, `iteration ${s.iteration}, sample ${s.sample}` + (s.replica === null ? "" : `, replica ${s.replica}`)));
  head.appendChild(html("p", null, `environment ${s.env} · seed ${s.seed} · reward ${fmt(s.reward)} · finish ${s.finish_reason} · ` +
    `${s.turns} turns · ${s.tokens} tokens (${s.policy_tokens} trained) · policy versions ${(s.turn_versions || []).join(", ")}` +
    (flags.length ? ` · ${flags.join(", ")}` : "") + (info.fork_reason ? ` · forked: ${info.fork_reason}` : "")));
  const legendKey = html("p", "key");
  legendKey.innerHTML = '<span class="seg trained">trained (sampled by the policy)</span><span class="seg untrained">not trained: prompt, template, tool and environment</span><span class="seg template">&lt;template&gt;</span><span class="seg tool-call">tool call</span>';
  head.appendChild(legendKey);
  const parts = [head];
  if (s.episode_rows.length) {
    const rows = html("div");
    rows.appendChild(html("h3", null, `this episode's ${s.episode_rows.length} rows`));
    for (const r of s.episode_rows) {
      const p = html("p", "note", `row ${r.fork ?? 0}${r.fork_reason ? ` forked: ${r.fork_reason}` : ""} · sample ${r.sample} · ${r.tokens} tokens`);
      p.style.cursor = "pointer";
      p.onclick = () => { location.hash = `episodes/${encodeURIComponent(r.key)}`; };
      rows.appendChild(p);
    }
    parts.push(rows);
  }
  for (const turn of s.conversation) {
    const d = html("div", `turn kind-${turn.kind}`);
    const who = html("div", "who", turn.kind === "tool" ? "tool answer" : turn.kind === "observation" ? "environment observation" : turn.kind);
    if (turn.versions.length) who.appendChild(html("span", "badge", `policy v${turn.versions.join(", v")}`));
    if (turn.spans.some(x => x.kind === "tool_call")) who.appendChild(html("span", "badge", "tool call"));
    d.appendChild(who);
    const pre = html("pre");
    for (const sp of turn.spans) {
      const cls = sp.kind === "template" ? "template" : sp.kind === "tool_call" ? "tool-call" : "";
      pre.appendChild(html("span", `seg ${sp.trained ? "trained" : "untrained"} ${cls}`, sp.text));
    }
    d.appendChild(pre);
    parts.push(d);
  }
  if (s.actions && s.actions.length) {
    parts.push(html("h3", null, "actions as the environment parsed them"));
    parts.push(html("pre", null, s.actions.map((a, i) => `${i + 1}. ${a}`).join("\n")));
  }
  box.replaceChildren(...parts);
}

// ---------------------------------------------------------------- wiring
let typing = null;
document.getElementById("filters").addEventListener("input", () => {
  clearTimeout(typing);
  typing = setTimeout(() => refreshSamples(true), 250);
});
document.getElementById("prev").onclick = () => { state.offset = Math.max(0, state.offset - PAGE); refreshSamples(true); };
document.getElementById("next").onclick = () => { if (state.offset + PAGE < state.total) { state.offset += PAGE; refreshSamples(true); } };
window.addEventListener("hashchange", route);
route();
pollRun();
