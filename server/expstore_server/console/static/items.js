// Trajectories: a table's newest items, optionally filtered by a SQL condition (a reward
// filter: "reward < 0.2 AND task = 'math'"); each links to the viewer.
"use strict";

document.addEventListener("DOMContentLoaded", async () => {
  const main = document.getElementById("main");
  let names = [];
  try { names = await tableNames(false); } catch (e) { fail(e); return; }
  if (!names.length) { clear(main, el("h1", {}, "Trajectories"), el("p", {class: "muted"}, "The store has no tables yet.")); return; }
  const table = param("table") && names.includes(param("table")) ? param("table") : names[0];
  const where = el("input", {name: "where", id: "where", placeholder: "SQL condition, e.g. reward < 0.2 AND task = 'math'",
                             style: {flex: "1 1 380px"}});
  where.value = param("where") || "";
  const limit = el("input", {name: "limit", type: "number", min: 1, max: 200, value: param("limit") || 50, style: {width: "80px"}});
  const picker = select("table", names, table);
  const idBox = el("input", {name: "id", type: "number", min: 0, placeholder: "item id", style: {width: "120px"}});
  const out = el("div", {id: "items"});
  const form = el("form", {class: "inline", onsubmit: (ev) => {
    ev.preventDefault();
    location.search = new URLSearchParams({table: picker.value, where: where.value, limit: limit.value}).toString();
  }}, "table", picker, "where", where, "newest", limit, el("button", {type: "submit"}, "Show"));
  const open = el("form", {class: "inline", onsubmit: (ev) => {
    ev.preventDefault();
    location.href = "/item?" + new URLSearchParams({table: picker.value, id: idBox.value}).toString();
  }}, "or open item", idBox, el("button", {type: "submit", class: "secondary"}, "Open"));
  clear(main, el("h1", {}, "Trajectories"), form, open, out);
  try {
    const data = await api("/api/items?" + new URLSearchParams({table: table, where: where.value, limit: limit.value}));
    clear(out, el("p", {class: "muted"}, data.rows.length + " newest item" + (data.rows.length === 1 ? "" : "s") +
                  " of " + table + (where.value ? " where " + where.value : "")),
          el("div", {class: "scroll"}, grid(data.columns, data.rows, (col, v) => {
            if (col === "item_id") return link("/item", {table: table, id: v}, String(v));
            if (col === "group_id" && v !== null) return link("/group", {table: table, group_id: v}, String(v));
            if (col === "reward") return sig(v);
            return undefined;
          })));
  } catch (e) { fail(e); }
});
