// The console's shared helpers. Everything from the store is untrusted text: it enters
// the DOM through el() (text nodes and setAttribute on a fixed set of attributes) or
// through plot() (which escapes it for plotly's label markup); never through innerHTML.
"use strict";

const NAV = [["/", "Tables"], ["/sql", "SQL"], ["/items", "Trajectories"], ["/manifest", "Manifests"],
             ["/audits", "Reward audits"], ["/hacking", "Reward hacking"]];
const ATTRIBUTES = new Set(["class", "id", "href", "title", "type", "value", "name", "placeholder", "rows", "cols",
                            "min", "max", "step", "for", "colspan", "download", "autocomplete", "spellcheck",
                            "selected", "disabled", "open", "role", "aria-label", "data-k", "data-table",
                            "data-tier", "data-op", "data-group", "data-i", "data-item", "data-mask"]);

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "style") Object.assign(node.style, v);
    else if (k === "href") node.setAttribute("href", safeHref(v));
    else if (ATTRIBUTES.has(k)) node.setAttribute(k, v === true ? "" : String(v));
    else throw new Error("el(): attribute " + k + " is not allowed");
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    node.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function clear(node, ...children) {
  node.replaceChildren();
  return append(node, children);
}

// Links the console builds: its own paths only (a value from the store can never become
// a javascript: URL).
function safeHref(v) {
  const s = String(v);
  return s.startsWith("/") && !s.startsWith("//") ? s : "#";
}

function link(path, params, text) {
  return el("a", {href: path + (params ? "?" + new URLSearchParams(params).toString() : "")}, text);
}

function param(name) {
  return new URLSearchParams(location.search).get(name);
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, body) {
  const init = {credentials: "same-origin", headers: {"X-Expstore-Console": "1"}};
  if (body !== undefined) {
    init.method = "POST";
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let res;
  try {
    res = await fetch(path, init);
  } catch (e) {
    throw new ApiError(0, "cannot reach the console: " + e.message);
  }
  let data = null;
  try { data = await res.json(); } catch (e) { /* not JSON */ }
  if (!res.ok) {
    const message = data && data.error ? data.error : res.status + " " + res.statusText;
    if (res.status === 401) showLogin(message);
    throw new ApiError(res.status, message);
  }
  return data;
}

// A failure of a page's request: the message as the store said it, in the banner.
function fail(e) {
  banner(e.message || String(e), "error");
}

function banner(message, kind) {
  const b = document.getElementById("banner");
  if (!message) { clear(b); b.className = ""; return; }
  clear(b, el("span", {}, message));
  b.className = kind || "info";
}

function showLogin(message) {
  if (document.getElementById("login")) {
    clear(document.getElementById("login-error"), message || "");
    return;
  }
  const input = el("input", {type: "password", name: "token", id: "login-token", autocomplete: "off",
                             placeholder: "bearer token", spellcheck: "false"});
  const error = el("p", {id: "login-error", class: "error-text"}, message || "");
  const form = el("form", {id: "login", class: "login", onsubmit: async (ev) => {
    ev.preventDefault();
    try {
      await api("/api/login", {token: input.value});
      location.reload();
    } catch (e) {
      clear(error, e.message);
    }
  }}, el("h2", {}, "Log in"),
     el("p", {}, "The store asks for a bearer token (the same tokens and roles as its RPCs; the console reads with role reader)."),
     el("label", {for: "login-token"}, "Token"), input, el("button", {type: "submit", id: "login-submit"}, "Log in"), error);
  document.body.appendChild(el("div", {class: "overlay"}, form));
  input.focus();
}

function navBar() {
  const here = location.pathname;
  const links = NAV.map(([path, title]) => el("a", {href: path, class: path === here ? "here" : null}, title));
  const logout = el("a", {href: "#", id: "logout", onclick: async (ev) => {
    ev.preventDefault();
    await api("/api/logout", {});
    showLogin("logged out");
  }}, "Log out");
  clear(document.getElementById("nav"), el("span", {class: "brand"}, "expstore"), links,
        el("span", {class: "spacer"}), el("a", {href: "#", onclick: (ev) => { ev.preventDefault(); showLogin(""); }},
        "Token"), logout);
}

// -- numbers --------------------------------------------------------------------------

function num(v, digits) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return v.toLocaleString("en-US");
  return v.toFixed(digits === undefined ? 2 : digits);
}

function sig(v) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  return Number.isInteger(v) ? String(v) : Number(v.toPrecision(4)).toString();
}

function bytes(v) {
  if (v === null || v === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return i === 0 ? v.toFixed(0) + " B" : v.toFixed(1) + " " + units[i];
}

// -- tables and forms -----------------------------------------------------------------

// columns: names; rows: arrays of cells; cells(name, value, row) may return a Node.
function grid(columns, rows, cells) {
  const head = el("tr", {}, columns.map((c) => el("th", {}, c)));
  const body = rows.map((r) => el("tr", {}, r.map((v, i) => {
    const custom = cells ? cells(columns[i], v, r) : undefined;
    const shown = custom !== undefined ? custom : (v === null ? "NULL" : typeof v === "object" ? JSON.stringify(v) : v);
    return el("td", {class: typeof v === "number" ? "num" : null}, shown);
  })));
  return el("table", {class: "grid"}, el("thead", {}, head), el("tbody", {}, body));
}

function keyValues(pairs) {
  return el("dl", {class: "facts"}, pairs.filter(([, v]) => v !== undefined).map(([k, v]) =>
    [el("dt", {}, k), el("dd", {"data-k": k}, v instanceof Node ? v : (v === null ? "-" : String(v)))]));
}

function select(name, options, current, onchange) {
  return el("select", {name: name, onchange: onchange},
            options.map((o) => el("option", {value: o, selected: o === current}, o)));
}

// Fills a <select> with the store's tables (trajectory tables only when asked).
async function tableNames(trajectoryOnly) {
  const data = await api("/api/tables");
  return data.tables.filter((t) => !trajectoryOnly || (t.config.kind || "trajectory") === "trajectory")
    .map((t) => t.name);
}

// Runs fn now and every ms milliseconds while the tab is visible; fn's errors go to the banner.
function every(ms, fn) {
  let timer = null;
  const tick = async () => {
    if (!document.hidden) {
      try { await fn(); } catch (e) { if (!(e instanceof ApiError && e.status === 401)) fail(e); else return; }
    }
    timer = setTimeout(tick, ms);
  };
  tick();
  return () => clearTimeout(timer);
}

// -- plots ------------------------------------------------------------------------------

// plotly reads <br>, <b>, <a href> and entities in labels: data goes in escaped.
function plotText(v) {
  return typeof v === "string" ? v.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;") : v;
}

function plot(node, traces, layout) {
  if (typeof Plotly === "undefined") {
    clear(node, el("p", {class: "muted"}, "plots need plotly.js (/static/plotly.min.js did not load)"));
    return;
  }
  const safe = traces.map((t) => {
    const c = Object.assign({}, t);
    for (const k of ["name", "text", "hovertext"]) if (k in c) c[k] = Array.isArray(c[k]) ? c[k].map(plotText) : plotText(c[k]);
    for (const k of ["x", "y"]) if (Array.isArray(c[k])) c[k] = c[k].map(plotText);
    return c;
  });
  const base = {margin: {l: 55, r: 55, t: 34, b: 45}, height: 260, font: {size: 12},
                paper_bgcolor: "#fff", plot_bgcolor: "#fafafa",
                legend: {orientation: "h", x: 0, y: 1.02, xanchor: "left", yanchor: "bottom"}};
  Plotly.react(node, safe, Object.assign(base, layout || {}), {displaylogo: false, responsive: true,
                                                                modeBarButtonsToRemove: ["lasso2d", "select2d"]});
}

// An x axis of policy versions: integer ticks, at most about ten of them.
function versionAxis(versions) {
  const span = versions.length ? Math.max(...versions) - Math.min(...versions) : 0;
  return {title: {text: "policy version"}, tickformat: "d", dtick: Math.max(1, Math.ceil(span / 10))};
}

function plotBox(title, note) {
  const box = el("div", {class: "plot"});
  return {node: el("figure", {class: "card plot-card"}, el("figcaption", {}, el("b", {}, title), note ? el("span", {class: "muted"}, " " + note) : null), box), box: box};
}

// -- GRPO groups ------------------------------------------------------------------------

// One item of a group: reward, components, finish reason, length, generated text.
function siblingCard(table, s, current) {
  const comps = s.reward_components ? Object.entries(s.reward_components).map(([k, v]) => k + " " + sig(v)).join(" · ") : null;
  return el("div", {class: "card sibling" + (String(s.item_id) === current ? " current" : ""), "data-item": s.item_id},
    el("div", {}, link("/item", {table: table, id: s.item_id}, "item " + s.item_id),
       el("span", {class: "badge"}, "v" + s.policy_version), el("span", {class: "badge"}, s.finish_reason)),
    el("div", {class: "big", "data-k": "reward"}, sig(s.reward)),
    comps ? el("div", {class: "muted"}, comps) : null,
    el("div", {class: "muted"}, s.num_generated + " generated tokens · ", s.traj_id),
    el("pre", {}, s.text !== null ? s.text : JSON.stringify(s.ids)));
}

document.addEventListener("DOMContentLoaded", navBar);
