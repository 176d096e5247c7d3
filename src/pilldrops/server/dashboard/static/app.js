// The PillDrops dashboard: sign-in, then a refresh loop (every few seconds, no reload) over the REST API.
// All text from the API goes in with textContent (never as HTML); the key lives in sessionStorage only.

import { api, ApiError, session } from "./api.js";
import { barChart, lineChart } from "./charts.js";

const REFRESH_MS = 2500;
const $ = (id) => document.getElementById(id);
const BIG_BATCH = 2000;        // past this many records, the chart aggregates refresh every 4th tick only
const state = { nodes: new Map(), admin: null, historyLimit: 250, timer: null, busy: false, again: false, live: [], tick: 0,
  statsKey: null, statsSize: 0 };

function h(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else if (k === "onclick") e.addEventListener("click", v);
    else e[k] = v;
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) e.append(c instanceof Node ? c : String(c));
  return e;
}

// ---- formatting ----------------------------------------------------------------------------------------

// axis labels: short (3 significant digits; an exponent below a tenth of a cent)
const usdTick = (v) => (v === 0 ? "$0" : Math.abs(v) < 0.001 ? `$${v.toExponential(1)}` : `$${+v.toPrecision(3)}`);

export function usd(v) {
  if (v === null || v === undefined) return "–";
  if (v === 0) return "$0";
  if (Math.abs(v) >= 1) return `$${v.toFixed(2)}`;
  if (Math.abs(v) >= 0.01) return `$${v.toFixed(4)}`;
  return `$${v.toFixed(Math.min(10, Math.ceil(-Math.log10(Math.abs(v))) + 2))}`;
}

function secs(s) {
  if (s === null || s === undefined || Number.isNaN(s)) return "–";
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.round((s % 86400) / 3600)} h`;
}

const ts = (iso) => (iso ? new Date(iso) : null);
const when = (iso) => (iso ? ts(iso).toLocaleString() : "–");
const clock = (ms) => new Date(ms).toLocaleTimeString();
const since = (iso, until) => (iso ? ((until ? ts(until) : Date.now()) - ts(iso)) / 1000 : null);

function metaChips(meta) {
  const entries = Object.entries(meta || {});
  if (!entries.length) return h("span", { class: "muted" }, "–");
  return h("span", {}, entries.map(([k, v]) => h("button", {
    type: "button", class: "chip", title: "filter the history by this", onclick: () => addFilter(k, v),
  }, `${k}=${v}`)));
}

function explain(err) {
  if (!(err instanceof ApiError)) return String(err);
  const rid = err.requestId ? ` (request ${err.requestId})` : "";
  return `${err.message}${err.code && err.code !== "network_error" ? ` [${err.code}]` : ""}${rid}`;
}

function show(id, text) {
  const e = $(id);
  e.textContent = text || "";
  e.hidden = !text;
}

let toastTimer = null;
function toast(text, isError = false) {
  const e = $("toast");
  e.textContent = text;
  e.className = isError ? "toast error" : "toast";
  e.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { e.hidden = true; }, isError ? 12000 : 5000);
}

// ---- filter (kept in the page's query string, so a link can select a batch; never the key) -------------

function readFilter() {
  const q = new URLSearchParams(location.search);
  const f = {};
  for (const [k, v] of q) if (k.startsWith("metadata.") || ["since", "until", "template"].includes(k)) f[k] = v;
  return f;
}

function writeFilter(f) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(f)) if (v) q.set(k, v);
  const s = q.toString();
  history.replaceState(null, "", `${location.pathname}${s ? `?${s}` : ""}${location.hash}`);
  fillFilterForm();
}

const toLocalInput = (iso) => {
  if (!iso) return "";
  const d = new Date(iso);
  return new Date(d.getTime() - d.getTimezoneOffset() * 60000).toISOString().slice(0, 19);
};

function fillFilterForm() {
  const f = readFilter();
  $("f-meta").value = Object.entries(f).filter(([k]) => k.startsWith("metadata."))
    .map(([k, v]) => `${k.slice(9)}=${v}`).join(" ");
  $("f-template").value = f.template || "";
  $("f-since").value = toLocalInput(f.since);
  $("f-until").value = toLocalInput(f.until);
}

function formFilter() {
  const f = {};
  for (const part of $("f-meta").value.split(/[\s,]+/).filter(Boolean)) {
    const i = part.indexOf("=");
    if (i <= 0) throw new Error(`metadata filter "${part}" is not key=value`);
    f[`metadata.${part.slice(0, i)}`] = part.slice(i + 1);
  }
  if ($("f-template").value.trim()) f.template = $("f-template").value.trim();
  if ($("f-since").value) f.since = new Date($("f-since").value).toISOString();
  if ($("f-until").value) f.until = new Date($("f-until").value).toISOString();
  return f;
}

function addFilter(k, v) {
  writeFilter({ ...readFilter(), [`metadata.${k}`]: v });
  $("history").scrollIntoView();
  refresh();
}

// ---- views ---------------------------------------------------------------------------------------------

function renderUsage(u) {
  $("credits").textContent = u.credits_unlimited ? "unlimited"
    : u.credits_usd === null ? "–" : `$${u.credits_usd.toPrecision(6)}`;
  $("credits").classList.toggle("low", !u.credits_unlimited && u.credits_usd !== null && u.credits_usd <= 0.5);
  $("spent").textContent = usd(u.cost_usd);
  $("count").textContent = String(u.sandboxes);
}

const VERBS = { pause: "Paused", resume: "Resumed", kill: "Killed" };

async function act(btn, verb, id) {
  btn.disabled = true;
  try {
    const sb = await api[verb](id);
    toast(`${VERBS[verb]} ${id}: now ${sb.state}${sb.state === "stopped" ? `, final cost ${usd(sb.cost_usd)}` : ""}`);
  } catch (e) {
    toast(`Could not ${verb} ${id}: ${explain(e)}`, true);
  } finally {
    btn.disabled = false;
    refresh();
  }
}

function renderLive(list) {
  state.live = list.items;
  $("running").textContent = String(list.items.filter((s) => s.state === "running").length);
  const rows = list.items.map((s) => h("tr", { "data-id": s.id, "data-state": s.state },
    h("td", { class: "id" }, s.id),
    h("td", {}, h("span", { class: `state ${s.state}` }, s.state)),
    h("td", {}, s.template),
    h("td", {}, s.isolation || s.runtime || "container"),
    h("td", { title: s.node_id || "" }, state.nodes.get(s.node_id) || s.node_id || "–"),
    h("td", {}, secs(since(s.created_at))),
    h("td", { class: "num cost" }, usd(s.cost_usd)),
    h("td", {}, metaChips(s.metadata)),
    h("td", { class: "actions" },
      s.state === "running" ? h("button", { type: "button", class: "pause",
        onclick: (e) => act(e.target, "pause", s.id) }, "Pause") : null,
      s.state === "paused" ? h("button", { type: "button", class: "resume",
        onclick: (e) => act(e.target, "resume", s.id) }, "Resume") : null,
      h("button", { type: "button", class: "kill danger",
        onclick: (e) => act(e.target, "kill", s.id) }, "Kill"))));
  $("live-table").querySelector("tbody").replaceChildren(...rows);
  $("live-table").hidden = !rows.length;
  show("live-more", list.next_cursor ? `Showing the newest ${rows.length} live sandboxes; there are more `
    + "(`pilldrops sandbox list` lists them all)." : "");
  show("live-empty", rows.length ? "" : "No sandboxes are running. Start some with `scripts/demo`, "
    + "`pilldrops sandbox create --template base`, or Sandbox.create(...) in Python; they show up here within seconds.");
}

function renderHistory(page, filtered) {
  const rows = page.items.map((r) => h("tr", { "data-id": r.id, "data-state": r.state },
    h("td", { class: "id" }, r.id),
    h("td", {}, r.template),
    h("td", {}, h("span", { class: `state ${r.state}` }, r.state)),
    h("td", { class: "end-reason" }, r.end_reason || "–"),
    h("td", {}, when(r.started_at)),
    h("td", {}, secs(since(r.started_at, r.ended_at))),
    h("td", { class: "num cost" }, usd(r.cost_usd)),
    h("td", {}, metaChips(r.metadata))));
  $("history-table").querySelector("tbody").replaceChildren(...rows);
  $("history-table").hidden = !rows.length;
  show("history-empty", rows.length ? "" : filtered
    ? "No sandbox matches this filter. Loosen it, or press Clear."
    : "No sandboxes yet. Run `scripts/demo` (200 rollouts) or create one; every sandbox gets a record here with its cost.");
  $("history-more").hidden = !page.next_cursor || state.historyLimit >= 1000;
}

function renderStats(st) {
  const n = st.sandboxes;
  const q = st.cost_quantiles || {};
  $("batch").textContent = n
    ? `${n} sandbox${n === 1 ? "" : "es"}${st.truncated ? " (the newest; more matched)" : ""}: total ${usd(st.cost_usd)}, `
      + `mean ${usd(st.mean_cost_usd)} per episode, p50 ${usd(q.p50)}, p90 ${usd(q.p90)}, p99 ${usd(q.p99)}, max ${usd(q.max)}`
    : "";
  const t = (p) => ts(p.t).getTime();
  const w = st.bucket_s * 1000;
  barChart($("chart-spend"), {
    label: "spend over time",
    bars: st.series.map((p) => ({ x0: t(p), x1: t(p) + w, y: p.spend_usd,
      title: `${clock(t(p))}: ${usd(p.spend_usd)}` })),
    xfmt: clock, yfmt: usdTick, emptyText: "No spend in this selection yet",
  });
  lineChart($("chart-running"), {
    label: "sandboxes running at once",
    series: [
      { name: "peak", cls: "peak", points: st.series.map((p) => [t(p), p.running_max]) },
      { name: "average", cls: "avg", area: true, points: st.series.map((p) => [t(p), p.running_avg]) },
    ],
    xfmt: clock, yfmt: (v) => (Number.isInteger(v) ? String(v) : v.toFixed(1)), step: w,
    emptyText: "No sandbox in this selection has started yet",
  });
  barChart($("chart-hist"), {
    label: "cost per episode",
    bars: st.cost_histogram.map((b) => ({ x0: b.lo, x1: b.hi > b.lo ? b.hi : b.lo + (b.lo || 1e-9), y: b.count,
      title: `${usd(b.lo)} – ${usd(b.hi)}: ${b.count} sandbox${b.count === 1 ? "" : "es"}` })),
    xfmt: usdTick, yfmt: (v) => (Number.isInteger(v) ? String(v) : v.toFixed(1)),
    emptyText: "No episodes in this selection",
  });
}

function bar(used, cap) {
  const pct = cap > 0 ? Math.min(100, (100 * used) / cap) : 0;
  const meter = h("meter", { min: 0, max: 100, value: pct, low: 70, high: 90, optimum: 0 });
  return h("span", { class: "alloc" }, meter, ` ${+used.toFixed(2)} / ${+cap.toFixed(2)} (${pct.toFixed(0)}%)`);
}

function renderNodes(list) {
  state.nodes = new Map(list.items.map((n) => [n.id, n.name]));
  const rows = list.items.map((n) => h("tr", { "data-id": n.id },
    h("td", { title: n.url }, n.name),
    h("td", {}, h("span", { class: `state ${n.state}` }, n.state + (n.draining ? " (draining)" : ""))),
    h("td", {}, bar(n.used_vcpu, n.capacity_vcpu)),
    h("td", {}, bar(n.used_memory_mb, n.capacity_memory_mb), " MiB"),
    h("td", { class: "num" }, n.sandboxes),
    h("td", {}, n.templates.join(", ") || "–"),
    h("td", {}, `${secs(since(n.last_heartbeat_at))} ago`)));
  $("nodes-table").querySelector("tbody").replaceChildren(...rows);
  $("nodes-table").hidden = !rows.length;
  show("nodes-empty", rows.length ? "" : "No node has registered. `pilldrops up` starts one; on a fleet, "
    + "join hosts with `pilldrops node --control-plane URL --node-token T`.");
}

function renderPools(list) {
  const rows = list.items.map((p) => h("tr", {},
    h("td", {}, p.template),
    h("td", {}, `${p.vcpu} vCPU, ${p.memory_mb} MiB`),
    h("td", { class: "num" }, p.size),
    h("td", { class: "num" }, p.ready),
    h("td", { class: "num" }, p.starting),
    h("td", { class: "num" }, p.hits),
    h("td", { class: "num" }, p.misses),
    h("td", { class: "num" }, p.hit_rate === null ? "–" : `${(100 * p.hit_rate).toFixed(1)}%`),
    h("td", { title: p.last_error || "" }, p.breaker_open ? `paused after failures: ${p.last_error || "?"}` : "ok")));
  $("pools-table").querySelector("tbody").replaceChildren(...rows);
  $("pools-table").hidden = !rows.length;
  show("pools-empty", rows.length ? "" : "No warm pools. Keep ready sandboxes of a template with "
    + "`pilldrops pools set code-interpreter --size 16 --vcpu 1 --memory-mb 512` (admin key); hit rates show here.");
}

// ---- refresh loop --------------------------------------------------------------------------------------

async function refresh() {
  if (!session.key) return;
  if (state.busy) {                 // a refresh asked for during one (a new filter, an action): right after it
    state.again = true;
    return;
  }
  state.again = false;
  state.busy = true;
  clearTimeout(state.timer);
  let filter;
  try {
    filter = readFilter();
    const filtered = Object.keys(filter).length > 0;
    const wantNodes = state.admin !== false;
    const key = JSON.stringify(filter);
    const wantStats = key !== state.statsKey || state.statsSize < BIG_BATCH || state.tick % 4 === 0;
    state.tick += 1;
    const [usage, nodes, live, hist, stats, pools] = await Promise.allSettled([
      api.usage(), wantNodes ? api.nodes() : Promise.resolve(null), api.live(),
      api.history(filter, state.historyLimit), wantStats ? api.stats(filter) : Promise.resolve(null), api.pools()]);
    const all = [usage, nodes, live, hist, stats, pools];
    const unauth = all.find((r) => r.status === "rejected" && r.reason.status === 401);
    if (unauth) {
      signOut(`Signed out: ${explain(unauth.reason)}. The key may have been revoked; sign in with a valid one.`);
      return;
    }
    if (nodes.status === "rejected" && nodes.reason.status === 403) {
      state.admin = false;
      $("nodes-table").hidden = true;
      show("nodes-empty", "Nodes (capacity and allocation) are shown to the operator's admin key only: sign in "
        + "with the key `pilldrops up` / `pilldrops serve` printed on first start.");
    } else if (nodes.status === "fulfilled" && nodes.value) {
      state.admin = true;
      renderNodes(nodes.value);
    }
    if (usage.status === "fulfilled") renderUsage(usage.value);
    if (live.status === "fulfilled") renderLive(live.value);
    if (hist.status === "fulfilled") renderHistory(hist.value, filtered);
    if (stats.status === "fulfilled" && stats.value) {
      state.statsKey = key;
      state.statsSize = stats.value.sandboxes;
      renderStats(stats.value);
    }
    if (pools.status === "fulfilled") renderPools(pools.value);
    const failed = all.filter((r) => r.status === "rejected" && r.reason.status !== 403);
    show("banner", failed.length ? `Could not refresh: ${explain(failed[0].reason)}. Retrying every `
      + `${REFRESH_MS / 1000} s.` : "");
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } finally {
    state.busy = false;
    if (session.key) state.timer = setTimeout(refresh, state.again ? 0 : REFRESH_MS);
  }
}

// ---- sign in / out -------------------------------------------------------------------------------------

function showApp(who) {
  $("signin").hidden = true;
  $("app").hidden = false;
  $("nav").hidden = false;
  $("who").hidden = false;
  $("team").textContent = `team ${who.team_name || who.team_id}`;
  fillFilterForm();
  refresh();
}

function signOut(message) {
  session.key = null;
  clearTimeout(state.timer);
  state.admin = null;
  $("app").hidden = true;
  $("nav").hidden = true;
  $("who").hidden = true;
  $("signin").hidden = false;
  show("signin-error", message || "");
  $("api-key").value = "";
  $("api-key").focus();
}

async function signIn(ev) {
  ev.preventDefault();
  const key = $("api-key").value.trim();
  show("signin-error", "");
  if (!key) return show("signin-error", "Type an API key first.");
  try {
    const who = await api.whoami(key);
    session.key = key;
    $("api-key").value = "";
    showApp(who);
  } catch (e) {
    show("signin-error", e.status === 401
      ? `That key was not accepted: ${explain(e)}. Use the key \`pilldrops up\` or \`scripts/demo\` printed `
        + "(also in ~/.config/pilldrops/config.json), or make one with `pilldrops keys create`."
      : `Could not sign in: ${explain(e)}`);
  }
}

function start() {
  $("signin-form").addEventListener("submit", signIn);
  $("signout").addEventListener("click", () => signOut("Signed out."));
  $("filter").addEventListener("submit", (ev) => {
    ev.preventDefault();
    try {
      writeFilter(formFilter());
      state.historyLimit = 250;
      refresh();
    } catch (e) {
      toast(e.message, true);
    }
  });
  $("f-clear").addEventListener("click", () => { writeFilter({}); refresh(); });
  $("history-more").addEventListener("click", () => {
    state.historyLimit = Math.min(1000, state.historyLimit + 250);
    refresh();
  });
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
  if (session.key) {
    api.whoami(session.key).then(showApp).catch((e) => signOut(e.status === 401
      ? `Your saved key is no longer accepted (${explain(e)}); sign in again.` : `Could not sign in: ${explain(e)}`));
  } else {
    signOut();
  }
}

start();
