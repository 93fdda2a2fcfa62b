// SQL: one SELECT over every table (the Query RPC: its limits, role reader), a paged
// grid of the first rows, downloads of every row as CSV or Parquet.
"use strict";

const EXAMPLE = "SELECT task, policy_version, count(*) AS items, avg(reward) AS reward\n" +
                "FROM rollouts GROUP BY ALL ORDER BY ALL";

function downloadHref(sql, format) {
  return "/api/download?" + new URLSearchParams({sql: sql, format: format}).toString();
}

function itemCells(tables) {
  // item_id cells link to the viewer when the statement reads one table by name
  return (col, v) => (col === "item_id" && tables.length === 1 && typeof v === "number")
    ? link("/item", {table: tables[0], id: v}, String(v)) : undefined;
}

function showPage(out, data, sql, tables, go) {
  const pager = el("div", {class: "pager"},
    el("button", {type: "button", class: "secondary", disabled: data.page === 0, onclick: () => go(data.page - 1)}, "‹ Previous"),
    el("span", {id: "page-info"}, "page " + (data.page + 1) + " of " + data.pages),
    el("button", {type: "button", class: "secondary", disabled: data.page + 1 >= data.pages, onclick: () => go(data.page + 1)}, "Next ›"),
    el("span", {class: "spacer"}),
    el("a", {href: downloadHref(sql, "csv"), id: "download-csv", download: "query.csv"}, "Download CSV"), " ",
    el("a", {href: downloadHref(sql, "parquet"), id: "download-parquet", download: "query.parquet"}, "Download Parquet"));
  const note = data.truncated ? " (the grid keeps the first " + num(data.total_rows) + "; the downloads have every row)" : "";
  clear(out, el("p", {id: "row-count"}, num(data.total_rows) + " row" + (data.total_rows === 1 ? "" : "s") + note), pager,
        el("div", {class: "scroll"}, grid(data.columns.map((c) => c.name), data.rows, itemCells(tables))));
}

function tablesIn(sql, known) {
  return known.filter((t) => new RegExp('(from|join)\\s+"?' + t.replace(/[.*+?^${}()|[\]\\]/g, "\\$&") + '"?(\\s|$|;)', "i").test(sql));
}

document.addEventListener("DOMContentLoaded", async () => {
  const main = document.getElementById("main");
  const box = el("textarea", {id: "sql", rows: 6, spellcheck: "false"});
  box.value = param("sql") || EXAMPLE;
  const out = el("div", {id: "result"});
  const run = el("button", {type: "submit", id: "run"}, "Run");
  let known = [];
  try { known = await tableNames(false); } catch (e) { fail(e); }
  const form = el("form", {onsubmit: async (ev) => {
    ev.preventDefault();
    const sql = box.value;
    run.disabled = true;
    clear(out, el("p", {class: "muted"}, "running…"));
    try {
      const first = await api("/api/query", {sql: sql});
      banner("");
      const tables = tablesIn(sql, known);
      const go = async (page) => {
        try {
          showPage(out, await api("/api/result?" + new URLSearchParams({id: first.result_id, page: page})), sql, tables, go);
        } catch (e) { fail(e); }
      };
      showPage(out, first, sql, tables, go);
      history.replaceState(null, "", "/sql?" + new URLSearchParams({sql: sql}).toString());
    } catch (e) {
      clear(out);
      fail(e);
    } finally {
      run.disabled = false;
    }
  }}, box, el("div", {class: "pager"}, run,
      el("span", {class: "muted"}, "One SELECT (DuckDB) over every table: the stored columns, item_id, priority, " +
         "times_sampled, inserted_at, tier, num_tokens, num_generated, num_turns, num_tool_calls. Ctrl+Enter runs it.")));
  box.addEventListener("keydown", (ev) => { if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) form.requestSubmit(); });
  clear(main, el("h1", {}, "SQL"), form, out);
  if (param("sql")) form.requestSubmit();
});
