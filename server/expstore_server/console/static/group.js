// A GRPO group side by side: every item with its reward, components, finish reason,
// length and generated text, best first; equal rewards (no advantage signal) flagged.
"use strict";

document.addEventListener("DOMContentLoaded", async () => {
  const main = document.getElementById("main");
  const table = param("table"), group = param("group_id");
  if (!table || group === null) {
    clear(main, el("h1", {}, "GRPO group"), el("p", {}, "Open a group from a trajectory."));
    return;
  }
  try {
    const g = await api("/api/group?" + new URLSearchParams({table: table, group_id: group}));
    const rewards = g.items.map((s) => s.reward).filter((r) => typeof r === "number");
    const mean = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null;
    clear(main, el("h1", {}, "GRPO group ", el("span", {class: "mono"}, g.group_id), " of ", link("/items", {table: table}, table)),
      el("p", {}, g.items.length + " items" + (g.truncated ? " (the first ones)" : "") + " · mean reward " + sig(mean) + " · " + g.tokenizer.note,
         g.zero_variance ? el("span", {class: "badge bad", id: "zero-variance"}, "all rewards equal: no GRPO advantage signal") : null),
      el("div", {class: "siblings"}, g.items.map((s) => siblingCard(table, s, param("item")))));
  } catch (e) {
    clear(main, el("h1", {}, "GRPO group"));
    fail(e);
  }
});
