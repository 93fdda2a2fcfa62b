// An audit's report (AuditReport.summary): counts, the histogram of delta, the top
// offenders and errors linked to their trajectories, splits by task, version, finish_reason.
"use strict";

function splitCard(key, rows) {
  const box = el("div", {class: "plot"});
  const x = rows.map((r) => r[key] === null ? "NULL" : String(r[key]));
  setTimeout(() => plot(box, [
    {type: "bar", name: "items", x: x, y: rows.map((r) => r.count), marker: {color: "#b8c7d9"}},
    {type: "bar", name: "failures", x: x, y: rows.map((r) => r.failures), marker: {color: "#d9534f"}}],
    {height: 220, barmode: "overlay", xaxis: {type: "category"}}), 0);
  return el("div", {class: "card"}, el("h3", {}, "by " + key), box,
            grid([key, "items", "failures", "mean |delta|"], rows.map((r) => [r[key], r.count, r.failures, r.mean_abs_delta]),
                 (c, v) => c === "mean |delta|" ? sig(v) : undefined));
}

document.addEventListener("DOMContentLoaded", async () => {
  const main = document.getElementById("main");
  const results = param("results_table"), id = param("audit_id");
  if (!results || !id) { clear(main, el("h1", {}, "Audit report"), el("p", {}, link("/audits", null, "Pick an audit."))); return; }
  let s;
  try { s = await api("/api/audit?" + new URLSearchParams({results_table: results, audit_id: id})); }
  catch (e) { clear(main, el("h1", {}, "Audit report")); fail(e); return; }
  const source = param("source") || s.source_table;
  const itemLink = (v) => source ? link("/item", {table: source, id: v}, String(v)) : String(v);
  const hist = el("div", {class: "plot"});
  const counts = ["ok", "mismatch", "error", "timeout", "unscored"];
  clear(main, el("h1", {}, "Audit ", el("span", {class: "mono"}, s.audit_id)),
    el("div", {class: "row"},
      el("div", {class: "card"}, keyValues([["reward function", s.reward_fn], ["source digest", s.reward_digest],
        ["results table", s.results_table], ["audited table", source || "(not found: the items are gone)"],
        ["items", s.count], ["components differ", s.component_mismatches],
        ["mean |delta|", sig(s.mean_abs_delta)], ["max |delta|", sig(s.max_abs_delta)]])),
      el("div", {class: "card"}, el("h3", {}, "Status"),
         grid(counts, [counts.map((k) => s[k])], (c, v) => el("span", {"data-k": c}, num(v))))),
    el("div", {class: "card"}, el("h3", {}, "delta = recomputed − stored"), hist),
    el("div", {class: "card"}, el("h3", {}, "Top offenders"), s.top_offenders.length ?
      grid(["source_item_id", "traj_id", "stored_reward", "recomputed_reward", "delta"],
           s.top_offenders.map((r) => [r.source_item_id, r.traj_id, r.stored_reward, r.recomputed_reward, r.delta]),
           (c, v) => c === "source_item_id" ? itemLink(v) : typeof v === "number" ? sig(v) : undefined)
      : el("p", {class: "muted"}, "no mismatches")),
    s.errors.length ? el("div", {class: "card"}, el("h3", {}, "Errors and timeouts"),
      grid(["source_item_id", "status", "error"], s.errors.map((r) => [r.source_item_id, r.status, r.error]),
           (c, v) => c === "source_item_id" ? itemLink(v) : undefined)) : null,
    el("div", {class: "cards"}, Object.entries(s.by).map(([key, rows]) => splitCard(key, rows))));
  plot(hist, [{type: "bar", x: s.histogram.map(([lo, hi]) => (lo + hi) / 2), y: s.histogram.map((h) => h[2]),
               width: s.histogram.map(([lo, hi]) => Math.max(hi - lo, 1e-9)), name: "items",
               hovertext: s.histogram.map(([lo, hi, k]) => "[" + sig(lo) + ", " + sig(hi) + "): " + k)}],
       {height: 240, xaxis: {title: {text: "delta"}}, yaxis: {title: {text: "items"}}});
});
