// One trajectory, turn by turn: roles, tool calls (arguments, result, status, latency),
// tokens (decoded with the table's tokenizer, or ids) as a heat map of logprob, policy
// version or advantage with the loss mask underlined, reward and its components, step
// rewards, and a link to the GRPO group's other items.
"use strict";

const MODES = {
  logprob: {label: "logprob (probability of the sampled token)", legend: "linear-gradient(90deg, hsl(0,75%,80%), hsl(60,75%,80%), hsl(120,55%,80%))",
            ends: ["p = 0", "p = 1"]},
  version: {label: "token policy version", legend: "linear-gradient(90deg, hsl(220,70%,92%), hsl(220,70%,62%))", ends: ["oldest", "newest"]},
  advantage: {label: "advantage", legend: "linear-gradient(90deg, hsl(220,70%,70%), #fff, hsl(0,70%,70%))", ends: ["negative", "positive"]},
};

function color(mode, t, i, range) {
  if (mode === "logprob") {
    if (!t.loss_mask || !t.loss_mask[i]) return null;
    const lp = t.logprobs ? t.logprobs[i] : null;
    if (typeof lp !== "number") return null;
    const p = Math.exp(Math.min(0, lp));
    return "hsl(" + Math.round(120 * p) + ", " + (p > 0.5 ? 55 : 75) + "%, 80%)";
  }
  if (mode === "version") {
    const v = t.token_policy_version ? t.token_policy_version[i] : null;
    if (typeof v !== "number") return null;
    const f = range.hi > range.lo ? (v - range.lo) / (range.hi - range.lo) : 1;
    return "hsl(220, 70%, " + Math.round(92 - 30 * f) + "%)";
  }
  const a = t.advantages ? t.advantages[i] : null;
  if (typeof a !== "number") return null;
  const f = Math.min(1, Math.abs(a) / (range.abs || 1));
  return "hsl(" + (a < 0 ? 220 : 0) + ", 70%, " + Math.round(100 - 30 * f) + "%)";
}

function tokenSpan(t, i, mode, range) {
  const id = t.tokens[i];
  const piece = t.pieces && t.pieces[i] !== null && t.pieces[i] !== undefined ? t.pieces[i] : null;
  const lp = t.logprobs ? t.logprobs[i] : null;
  const tip = ["#" + i, "id " + id, piece !== null ? "piece " + JSON.stringify(piece) : null,
               "loss_mask " + (t.loss_mask ? t.loss_mask[i] : "-"),
               typeof lp === "number" ? "logprob " + lp.toFixed(4) + " (p " + Math.exp(lp).toFixed(3) + ")" : null,
               t.token_policy_version ? "policy version " + t.token_policy_version[i] : null,
               t.advantages ? "advantage " + sig(t.advantages[i]) : null,
               t.values ? "value " + sig(t.values[i]) : null].filter(Boolean).join("  ·  ");
  const span = el("span", {class: "tok", title: tip, "data-i": i, "data-mask": t.loss_mask ? t.loss_mask[i] : null},
                  piece !== null ? piece : "[" + id + "]");
  const bg = color(mode, t, i, range);
  if (bg) span.style.background = bg;
  return span;
}

function segmentNode(item, seg, mode, range) {
  const t = item.tokens;
  const kind = seg.role || (seg.title === "prompt" ? "prompt" : "other");
  const spans = [];
  for (let i = seg.start; i < Math.min(seg.end, item.tokens_shown); i++) spans.push(tokenSpan(t, i, mode, range));
  let tool = null;
  if (seg.tool) {
    const s = seg.tool;
    tool = el("div", {class: "tool-call"},
      el("div", {}, el("b", {class: "mono"}, s.tool_name), el("span", {class: "mono"}, "(" + (s.tool_args === null ? "" : s.tool_args) + ")"),
         el("span", {class: "badge " + (s.tool_status === "ok" ? "ok" : "bad")}, s.tool_status === null ? "no status" : s.tool_status),
         el("span", {class: "muted"}, s.latency_ms === null ? "" : "  " + sig(s.latency_ms) + " ms")),
      el("pre", {class: "tool-result"}, s.tool_result === null ? "(no result)" : s.tool_result));
  }
  const masked = t.loss_mask ? t.loss_mask.slice(seg.start, seg.end).reduce((a, b) => a + b, 0) : 0;
  return el("div", {class: "segment " + kind},
    el("h3", {}, seg.title, el("span", {class: "muted"}, "  tokens [" + seg.start + ", " + seg.end + ") · " + masked + " trained (loss_mask 1)")),
    tool, seg.text !== null && seg.text !== undefined && seg.text !== piecesText(t, seg) ? el("pre", {class: "segment-text"}, seg.text) : null,
    el("div", {class: "tokens"}, spans));
}

// The segment's pieces end to end (the decoded text is shown apart only when it differs,
// e.g. a byte-level tokenizer whose pieces split characters).
function piecesText(t, seg) {
  if (!t.pieces) return null;
  return t.pieces.slice(seg.start, seg.end).map((p) => p === null ? "\ufffd" : p).join("");
}

function ranges(t) {
  const v = (t.token_policy_version || []).filter((x) => typeof x === "number");
  const a = (t.advantages || []).filter((x) => typeof x === "number");
  return {lo: v.length ? Math.min(...v) : 0, hi: v.length ? Math.max(...v) : 0,
          abs: a.length ? Math.max(...a.map(Math.abs)) : 1};
}

function rewardPanel(item) {
  const comps = item.reward_components || {};
  const names = Object.keys(comps);
  const panel = el("div", {class: "card"}, el("h3", {}, "Reward"),
                   el("div", {class: "big", "data-k": "reward"}, sig(item.reward)));
  if (names.length) {
    panel.appendChild(grid(["component", "value"], names.map((k) => [k, comps[k]]), (c, v) => typeof v === "number" ? sig(v) : undefined));
  }
  const steps = item.step_rewards;
  if (steps && steps.length) {
    const box = el("div", {class: "plot"});
    panel.append(el("h3", {}, "Step rewards"), box);
    setTimeout(() => plot(box, [{type: "bar", x: steps.map((_, i) => i), y: steps, name: "step reward"}],
                          {height: 180, xaxis: {title: {text: "step"}}}), 0);
  }
  return panel;
}

function tokenPlot(item) {
  const t = item.tokens;
  const n = item.tokens_shown;
  const x = [...Array(n).keys()];
  const traces = [{type: "scatter", mode: "lines", name: "logprob", x: x, y: t.logprobs, line: {width: 1}},
                  {type: "scatter", mode: "lines", name: "loss mask", x: x, y: t.loss_mask, yaxis: "y2", fill: "tozeroy",
                   line: {width: 0, shape: "hv"}, fillcolor: "rgba(47,111,176,0.15)"}];
  if (t.token_policy_version && new Set(t.token_policy_version).size > 1) traces.push({type: "scatter", mode: "lines", name: "token policy version", x: x,
                                           y: t.token_policy_version, yaxis: "y3", line: {shape: "hv", dash: "dot"}});
  const box = el("div", {class: "plot"});
  const layout = {height: 240, xaxis: {title: {text: "token"}}, yaxis: {title: {text: "logprob"}},
    yaxis2: {overlaying: "y", side: "right", range: [0, 1.05], showticklabels: false, showgrid: false}};
  if (traces.length > 2) layout.yaxis3 = {overlaying: "y", side: "right", showgrid: false, tickformat: "d", title: {text: "version"}};
  setTimeout(() => plot(box, traces, layout), 0);
  return el("div", {class: "card"}, el("h3", {}, "Per token"), box);
}

function renderTurns(box, item, mode) {
  const range = ranges(item.tokens);
  const modes = Object.keys(MODES).filter((m) => m === "logprob" || (m === "version" && item.tokens.token_policy_version) ||
                                                 (m === "advantage" && item.tokens.advantages));
  const modeSelect = select("mode", modes, mode, (ev) => renderTurns(box, item, ev.target.value));
  modeSelect.id = "heat-mode";
  const legend = el("div", {class: "legend"}, "color:", modeSelect, el("span", {}, MODES[mode].ends[0]),
    el("span", {class: "swatch", style: {background: MODES[mode].legend}}), el("span", {}, MODES[mode].ends[1]),
    el("span", {class: "muted"}, " · underlined: loss_mask 1 (trained on); grey text: loss_mask 0 · hover a token for its numbers"));
  const note = el("p", {class: "muted", id: "tokenizer-note"}, item.tokenizer.note +
    (item.tokens_shown < item.num_tokens ? " · first " + item.tokens_shown + " of " + item.num_tokens + " tokens shown" : ""));
  clear(box, el("h2", {}, "Turn by turn"), note, legend, item.segments.map((s) => segmentNode(item, s, mode, range)));
}

function tokenVersions(t) {
  if (!t.token_policy_version) return undefined;
  const v = t.token_policy_version.filter((x) => typeof x === "number");
  return v.length ? (Math.min(...v) === Math.max(...v) ? String(v[0]) + " (every token)" : Math.min(...v) + " to " + Math.max(...v)) : undefined;
}

function render(main, item) {
  const f = item.facts;
  const table = item.table;
  const title = el("h1", {}, "Item " + item.item_id + " of ", link("/items", {table: table}, table));
  if (item.columns) {  // a generic table
    clear(main, title, el("div", {class: "card"}, keyValues(Object.entries(item.columns).map(([k, v]) =>
      [k, typeof v === "object" && v !== null ? JSON.stringify(v) : v]))));
    return;
  }
  const facts = keyValues([
    ["traj_id", f.traj_id], ["task", f.task], ["prompt_id", f.prompt_id],
    ["group_id", f.group_id === null ? null : link("/group", {table: table, group_id: f.group_id, item: item.item_id}, f.group_id)],
    ["policy_version", f.policy_version], ["token policy versions", tokenVersions(item.tokens)],
    ["finish_reason", f.finish_reason], ["tier", f.tier],
    ["priority", sig(f.priority)], ["times_sampled", f.times_sampled],
    ["tokens", f.num_tokens], ["generated (loss_mask 1)", f.num_generated], ["turns", f.num_turns], ["tool calls", f.num_tool_calls]]);
  const extra = Object.keys(item.extra || {}).length ?
    el("details", {}, el("summary", {}, "Other columns"), keyValues(Object.entries(item.extra).map(([k, v]) =>
      [k, typeof v === "object" && v !== null ? JSON.stringify(v) : v]))) : null;
  const turns = el("div", {class: "card", id: "turns"});
  clear(main, title,
    el("div", {class: "row"}, el("div", {class: "card"}, el("h3", {}, "Item"), facts), rewardPanel(item),
       item.metadata !== null ? el("div", {class: "card"}, el("h3", {}, "metadata"), el("pre", {id: "metadata"}, item.metadata)) : null),
    tokenPlot(item), extra, turns);
  renderTurns(turns, item, "logprob");
}

document.addEventListener("DOMContentLoaded", async () => {
  const main = document.getElementById("main");
  const table = param("table"), id = param("id");
  if (!table || id === null) {
    clear(main, el("h1", {}, "Trajectory"), el("p", {}, "Pick an item on the ", link("/items", null, "Trajectories"), " page."));
    return;
  }
  try {
    const item = await api("/api/item?" + new URLSearchParams({table: table, id: id}));
    render(main, item);
    if (item.facts && item.facts.group_id !== null && item.facts.group_id !== undefined) {
      const g = await api("/api/group?" + new URLSearchParams({table: table, group_id: item.facts.group_id}));
      const box = el("div", {class: "card", id: "siblings"},
        el("h2", {}, "GRPO group ", link("/group", {table: table, group_id: g.group_id, item: id}, g.group_id),
           el("span", {class: "muted"}, " · " + g.items.length + " items, best reward first"),
           g.zero_variance ? el("span", {class: "badge bad"}, "all rewards equal: no advantage signal") : null),
        el("div", {class: "siblings"}, g.items.map((s) => siblingCard(table, s, id))));
      main.insertBefore(box, document.getElementById("turns"));
    }
  } catch (e) {
    clear(main, el("h1", {}, "Trajectory"));
    fail(e);
  }
});
