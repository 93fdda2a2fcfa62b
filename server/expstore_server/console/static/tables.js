// Tables: each table's config, tiers, rates, waits, staleness and consumer groups, live
// (the figures of `expstore stats --watch`, from the Stats RPC).
"use strict";

const TIERS = ["memory", "ssd", "remote"];
const cards = new Map();  // table name -> {node, parts}

function tierTable(t, f) {
  return grid(["tier", "items", "bytes"], TIERS.map((tier) => [tier, f.tiers[tier].items, f.tiers[tier].bytes]),
              (col, v, row) => {
                const attrs = {"data-table": t.name, "data-tier": row[0], "data-k": col};
                if (col === "items") return el("span", attrs, num(v));
                if (col === "bytes") return el("span", attrs, bytes(v));
                return undefined;
              });
}

function rateList(t, f) {
  return keyValues(Object.entries(f.rates).map(([label, r]) =>
    [label + " /s", el("span", {"data-table": t.name, "data-k": "rate-" + label}, r === null ? "-" : r.toFixed(1))]));
}

function waitTable(t, f) {
  return grid(["op", "waits", "seconds"], Object.entries(f.waits).map(([op, w]) => [op, w.calls, w.seconds]),
              (col, v, row) => col === "seconds" ? v.toFixed(2) :
                col === "waits" ? el("span", {"data-table": t.name, "data-op": row[0], "data-k": "waits"}, num(v)) : undefined);
}

function groupTable(t, f) {
  const names = Object.keys(f.groups).sort();
  if (!names.length) return el("p", {class: "muted"}, "no consumer groups");
  const fields = ["lag", "inflight", "delivered", "redelivered", "acked"];
  return grid(["group", "lag", "unacked", "delivered", "redelivered", "acked"],
              names.map((g) => [g, ...fields.map((k) => f.groups[g][k])]),
              (col, v, row) => col === "group" ? undefined :
                el("span", {"data-table": t.name, "data-group": row[0], "data-k": col}, num(v)));
}

// Per-bucket counts from the cumulative "within N versions" counts.
function stalenessTraces(f) {
  return Object.entries(f.staleness).map(([op, st]) => {
    const x = [], y = [];
    let prev = 0;
    for (const [bound, within] of st.buckets) { x.push("≤ " + bound); y.push(within - prev); prev = within; }
    if (st.total > prev) { x.push("more"); y.push(st.total - prev); }
    return {type: "bar", name: op + " (mean " + (st.mean === null ? "-" : st.mean.toFixed(2)) + ")", x: x, y: y};
  });
}

function card(t) {
  const parts = {
    head: el("div", {}), tiers: el("div", {}), rates: el("div", {}), waits: el("div", {}), groups: el("div", {}),
    config: el("pre", {}), columns: el("div", {}), ratePlot: el("div", {class: "plot"}), stalePlot: el("div", {class: "plot"}),
  };
  const node = el("section", {class: "card", "data-table": t.name},
    parts.head,
    el("div", {class: "row"},
       el("div", {class: "card"}, el("h3", {}, "Tiers"), parts.tiers),
       el("div", {class: "card"}, el("h3", {}, "Rates"), parts.rates, parts.ratePlot),
       el("div", {class: "card"}, el("h3", {}, "Rate-limiter waits"), parts.waits),
       el("div", {class: "card"}, el("h3", {}, "Staleness of returned items (versions behind)"), parts.stalePlot),
       el("div", {class: "card"}, el("h3", {}, "Consumer groups (stream lag)"), parts.groups)),
    el("details", {}, el("summary", {}, "Config"), parts.config),
    el("details", {}, el("summary", {}, "Columns"), parts.columns));
  return {node, parts};
}

function update(c, t) {
  const f = t.figures;
  const kind = t.config.kind || "trajectory";
  clear(c.parts.head, el("h2", {}, t.name, el("span", {class: "badge"}, kind),
                         el("span", {class: "badge"}, (t.config.sampler || {}).type || "uniform"),
                         el("span", {class: "badge"}, t.config.tiers || "")),
        el("p", {class: "muted"}, "items ", el("b", {"data-table": t.name, "data-k": "items"}, num(f ? f.items : t.num_items)),
           " · eligible for sampling ", el("b", {"data-table": t.name, "data-k": "eligible"}, f ? num(f.eligible) : "-"),
           " · policy version ", el("b", {"data-table": t.name, "data-k": "policy_version"}, num(t.policy_version)), " · ",
           link("/items", {table: t.name}, "trajectories"), " · ", link("/hacking", {table: t.name}, "reward hacking"),
           " · ", link("/sql", {sql: 'SELECT * FROM "' + t.name.replace(/"/g, '""') + '" ORDER BY item_id DESC LIMIT 100'}, "query")));
  c.parts.config.textContent = JSON.stringify(t.config, null, 2);
  clear(c.parts.columns, grid(["column", "type"], t.columns.map((x) => [x.name, x.type])));
  if (!f) return;
  clear(c.parts.tiers, tierTable(t, f));
  clear(c.parts.rates, rateList(t, f));
  clear(c.parts.waits, waitTable(t, f));
  clear(c.parts.groups, groupTable(t, f));
  const r = t.rates;
  plot(c.parts.ratePlot, ["inserted", "sampled", "streamed"].map((k) => ({type: "scatter", mode: "lines", name: k, x: r.t, y: r[k]})),
       {height: 180, xaxis: {title: {text: "seconds ago"}}, yaxis: {title: {text: "items/s"}, rangemode: "tozero"}});
  plot(c.parts.stalePlot, stalenessTraces(f), {height: 200, barmode: "group", yaxis: {title: {text: "items"}}});
}

async function refresh(main) {
  const data = await api("/api/tables");
  banner("");
  if (!data.tables.length) {
    clear(main, el("h1", {}, "Tables"), el("p", {class: "muted"}, "The store has no tables yet."));
    cards.clear();
    return;
  }
  if (!main.querySelector("h1")) clear(main, el("h1", {}, "Tables"), el("p", {class: "muted"}, "Live: refreshed every 2 s."));
  const names = new Set(data.tables.map((t) => t.name));
  for (const [name, c] of cards) if (!names.has(name)) { c.node.remove(); cards.delete(name); }
  for (const t of data.tables) {
    let c = cards.get(t.name);
    if (!c) { c = card(t); cards.set(t.name, c); main.appendChild(c.node); }
    update(c, t);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const main = document.getElementById("main");
  every(2000, () => refresh(main));
});
