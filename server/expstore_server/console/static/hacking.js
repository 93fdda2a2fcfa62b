// Reward hacking, per policy version: reward vs generated length (drift), zero-variance
// GRPO groups (collapse), reward-component dominance, finish_reason mix, tool errors.
// One SQL statement over the store per refresh, the figures SQL in the console
// (console/hacking.py); live every 30 s.
"use strict";

function byVersion(rows, key, value) {
  // {key value: {version: value}} from columns {version: [...], key: [...], value: [...]}
  const out = new Map();
  rows.version.forEach((v, i) => {
    const k = rows[key][i] === null ? "NULL" : String(rows[key][i]);
    if (!out.has(k)) out.set(k, new Map());
    out.get(k).set(v, rows[value][i]);
  });
  return out;
}

function shares(rows, key, value) {
  const versions = [...new Set(rows.version)];
  const per = byVersion(rows, key, value);
  const totals = new Map(versions.map((v) => [v, 0]));
  for (const m of per.values()) for (const [v, x] of m) totals.set(v, totals.get(v) + Math.abs(x));
  return [...per.entries()].map(([k, m]) => ({type: "bar", name: k, x: versions,
    y: versions.map((v) => totals.get(v) ? Math.abs(m.get(v) || 0) / totals.get(v) : 0)}));
}

function draw(boxes, d) {
  const VERSION_AXIS = versionAxis([].concat(d.drift.version, d.finish.version));
  const empty = (box, note) => clear(box, el("p", {class: "muted"}, note));
  const dr = d.drift;
  if (dr.version.length) {
    plot(boxes.drift, [
      {type: "scatter", mode: "lines+markers", name: "mean reward", x: dr.version, y: dr.reward},
      {type: "scatter", mode: "lines+markers", name: "mean generated tokens", x: dr.version, y: dr.length, yaxis: "y2"}],
      {xaxis: VERSION_AXIS, yaxis: {title: {text: "reward"}}, yaxis2: {title: {text: "tokens"}, overlaying: "y", side: "right"}});
    plot(boxes.corr, [{type: "bar", name: "corr(reward, length)", x: dr.version, y: dr.correlation}],
         {xaxis: VERSION_AXIS, yaxis: {range: [-1, 1], title: {text: "Pearson r"}}});
  } else { empty(boxes.drift, "no rewarded items"); empty(boxes.corr, "no rewarded items"); }
  const sc = d.scatter;
  if (sc.version.length) {
    plot(boxes.scatter, [{type: "scatter", mode: "markers", name: "items", x: sc.length, y: sc.reward,
      text: sc.item_id.map((id, i) => "item " + id + " · v" + sc.version[i]),
      marker: {size: 6, opacity: 0.6, color: sc.version, colorscale: "Viridis", showscale: true, colorbar: {title: {text: "version"}}}}],
      {xaxis: {title: {text: "generated tokens (num_generated)"}}, yaxis: {title: {text: "reward"}}, showlegend: false});
  } else empty(boxes.scatter, "no rewarded items");
  const c = d.collapse;
  if (c.version.length) {
    plot(boxes.collapse, [{type: "bar", name: "zero-variance groups", x: c.version,
      y: c.version.map((_, i) => c.groups[i] ? c.zero_variance[i] / c.groups[i] : 0),
      hovertext: c.version.map((v, i) => c.zero_variance[i] + " of " + c.groups[i] + " groups")}],
      {xaxis: VERSION_AXIS, yaxis: {range: [0, 1], tickformat: ".0%", title: {text: "share of groups"}}});
  } else empty(boxes.collapse, "no GRPO groups (rows sharing a group_id) with rewards");
  const comp = d.components;
  if (comp.version.length) {
    plot(boxes.components, shares(comp, "component", "mean_abs"),
         {barmode: "stack", xaxis: VERSION_AXIS, yaxis: {range: [0, 1], tickformat: ".0%", title: {text: "share of mean |value|"}}});
  } else empty(boxes.components, "no reward_components stored");
  const fin = d.finish;
  if (fin.version.length) {
    plot(boxes.finish, shares(fin, "finish_reason", "items"),
         {barmode: "stack", xaxis: VERSION_AXIS, yaxis: {range: [0, 1], tickformat: ".0%", title: {text: "share of items"}}});
  } else empty(boxes.finish, "no items");
  const t = d.tools;
  if (t.version.length) {
    plot(boxes.tools, [{type: "scatter", mode: "lines+markers", name: "error rate", x: t.version,
      y: t.version.map((_, i) => t.calls[i] ? t.errors[i] / t.calls[i] : 0),
      hovertext: t.version.map((v, i) => t.errors[i] + " of " + t.calls[i] + " calls not ok")}],
      {xaxis: VERSION_AXIS, yaxis: {rangemode: "tozero", tickformat: ".0%", title: {text: "tool calls not ok"}}});
  } else empty(boxes.tools, "no tool calls (turns with a tool_name)");
}

document.addEventListener("DOMContentLoaded", async () => {
  const main = document.getElementById("main");
  let names = [];
  try { names = await tableNames(true); } catch (e) { fail(e); return; }
  if (!names.length) { clear(main, el("h1", {}, "Reward hacking"), el("p", {class: "muted"}, "No trajectory tables yet.")); return; }
  const table = param("table") && names.includes(param("table")) ? param("table") : names[0];
  const versions = el("input", {name: "versions", type: "number", min: 1, value: param("versions") || 50, style: {width: "80px"}});
  const picker = select("table", names, table);
  const form = el("form", {class: "inline", onsubmit: (ev) => {
    ev.preventDefault();
    location.search = new URLSearchParams({table: picker.value, versions: versions.value}).toString();
  }}, "table", picker, "last", versions, "policy versions", el("button", {type: "submit"}, "Show"));
  const spec = [["drift", "Reward and generated length", "rising together can mean length is being rewarded"],
                ["corr", "Correlation of reward with length", "per version; near +1 is a warning"],
                ["scatter", "Reward vs generated length", "a sample of items, colored by version"],
                ["collapse", "Zero-variance GRPO groups", "groups whose rewards are all equal carry no signal"],
                ["components", "Reward-component dominance", "each component's share of the total"],
                ["finish", "finish_reason mix", "e.g. a policy learning to hit the length limit"],
                ["tools", "Tool-call error rate", "tool calls whose status is not ok"]];
  const boxes = {};
  const figures = spec.map(([key, title, note]) => { const p = plotBox(title, note); p.box.id = "plot-" + key; boxes[key] = p.box; return p.node; });
  const info = el("p", {class: "muted", id: "hacking-info"}, "reading the table… (one scan of its last policy versions)");
  clear(main, el("h1", {}, "Reward hacking"), form, info, el("div", {class: "cards"}, figures));
  every(30000, async () => {
    const d = await api("/api/hacking?" + new URLSearchParams({table: table, versions: versions.value}));
    const seen = d.finish.version;
    clear(info, "table " + d.table + " · items of policy versions " + (seen.length ? Math.min(...seen) + " to " + Math.max(...seen) : "-") +
          " (the table is at version " + d.policy_version + ") · " + num(d.rows) + " items" +
          (d.truncated ? " (the first read; narrow the versions for all)" : "") + " · refreshed every 30 s · " + new Date().toLocaleTimeString());
    draw(boxes, d);
  });
});
