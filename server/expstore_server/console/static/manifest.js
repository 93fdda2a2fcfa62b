// Manifests: what training step N sampled (GetManifest), each item linked to the viewer.
"use strict";

document.addEventListener("DOMContentLoaded", async () => {
  const main = document.getElementById("main");
  let names = [];
  try { names = await tableNames(false); } catch (e) { fail(e); return; }
  const table = param("table") && names.includes(param("table")) ? param("table") : names[0];
  const picker = select("table", names, table);
  const step = el("input", {name: "step", id: "step", type: "number", min: 0, placeholder: "training step", style: {width: "140px"}});
  step.value = param("step") || "";
  const out = el("div", {id: "manifest"});
  const form = el("form", {class: "inline", onsubmit: (ev) => {
    ev.preventDefault();
    location.search = new URLSearchParams({table: picker.value, step: step.value}).toString();
  }}, "table", picker, "step", step, el("button", {type: "submit", id: "show-manifest"}, "Show"));
  clear(main, el("h1", {}, "Manifests"),
        el("p", {class: "muted"}, "A trainer that samples with step=N (client.sample(table, n, step=N)) records what step N trained on."),
        form, out);
  if (!table || !param("step")) return;
  try {
    const m = await api("/api/manifest?" + new URLSearchParams({table: table, step: param("step")}));
    const versions = {};
    for (const r of m.items) versions[r.policy_version] = (versions[r.policy_version] || 0) + 1;
    const cols = ["item_id", "policy_version", "traj_id", "task", "group_id", "reward", "finish_reason", "num_generated"];
    clear(out, el("p", {id: "manifest-summary"}, "step " + m.step + " of " + m.table + ": " + m.items.length + " draws, " +
                  m.distinct + " distinct items" + (m.gone ? ", " + m.gone + " no longer in the table" : "") +
                  " · policy versions: " + Object.entries(versions).map(([v, n]) => "v" + v + " × " + n).join(", ")),
      el("div", {class: "scroll"}, grid(cols, m.items.map((r) => cols.map((c) => r[c] === undefined ? null : r[c])), (col, v, row) => {
        if (col === "item_id") return link("/item", {table: table, id: v}, String(v));
        if (col === "group_id" && v !== null) return link("/group", {table: table, group_id: v}, String(v));
        if (col === "reward") return sig(v);
        return undefined;
      })));
  } catch (e) { fail(e); }
});
