// Reward audits: the audits stored in the store (results tables) and a form to run one
// with a reward function the console allows (roles of `expstore audit --out TABLE`).
"use strict";

document.addEventListener("DOMContentLoaded", async () => {
  const main = document.getElementById("main");
  let data;
  try { data = await api("/api/audits"); } catch (e) { clear(main, el("h1", {}, "Reward audits")); fail(e); return; }
  const table = select("table", data.trajectory_tables, param("table") || data.trajectory_tables[0]);
  const reward = select("reward", data.rewards, data.rewards[0]);
  const where = el("input", {name: "where", placeholder: "SQL condition (optional)", style: {flex: "1 1 260px"}});
  const limit = el("input", {name: "limit", type: "number", min: 1, value: 1000, style: {width: "100px"}});
  const out = el("input", {name: "out", value: "audits", style: {width: "140px"}});
  const go = el("button", {type: "submit", id: "run-audit", disabled: !data.rewards.length || !data.trajectory_tables.length}, "Run audit");
  const status = el("span", {class: "muted", id: "audit-status"});
  const form = el("form", {class: "inline", onsubmit: async (ev) => {
    ev.preventDefault();
    go.disabled = true;
    clear(status, "auditing… (rewards are recomputed in worker processes)");
    try {
      const r = await api("/api/audit/run", {table: table.value, reward: reward.value, where: where.value,
                                             limit: limit.value, out: out.value});
      location.href = "/audit?" + new URLSearchParams({results_table: r.results_table, audit_id: r.audit_id,
                                                       source: r.source_table}).toString();
    } catch (e) {
      clear(status);
      fail(e);
    } finally {
      go.disabled = false;
    }
  }}, "table", table, "reward", reward, "where", where, "at most", limit, "rows; results to", out, go, status);
  const cols = ["audit_id", "results_table", "reward_fn", "items", "ok", "mismatch", "errors", "reward_digest"];
  const list = data.audits.length ? grid(cols, data.audits.map((a) => cols.map((c) => a[c])), (col, v, row) =>
      col === "audit_id" ? link("/audit", {results_table: row[1], audit_id: v}, String(v)) :
      col === "reward_digest" && v ? el("span", {class: "mono muted"}, String(v).slice(0, 19) + "…") : undefined)
    : el("p", {class: "muted"}, "No audits stored yet (tables with the columns of expstore audit --out TABLE).");
  clear(main, el("h1", {}, "Reward audits"),
        el("div", {class: "card"}, el("h2", {}, "Run an audit"),
           el("p", {class: "muted"}, "Recomputes each row's reward and compares it with the stored one, as expstore audit does. " +
              "Needs a token with roles reader, admin (to create the results table) and producer (to insert the results)."),
           data.rewards.length ? form : el("p", {}, "This console runs no reward functions (start it with --reward MODULE:FUNC).")),
        el("div", {class: "card"}, el("h2", {}, "Stored audits"), el("div", {class: "scroll"}, list)));
});
