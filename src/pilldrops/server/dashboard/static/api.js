// The REST client of the dashboard: every call sends the signed-in key as a Bearer header and turns
// every failure into an ApiError carrying the API's typed error (code, message, request_id) or a
// network error that says what to check.

const KEY = "pilldrops.api_key";

export class ApiError extends Error {
  constructor(status, code, message, requestId) {
    super(message);
    this.status = status;
    this.code = code;
    this.requestId = requestId;
  }
}

export const session = {
  get key() { return sessionStorage.getItem(KEY); },
  set key(v) { if (v) sessionStorage.setItem(KEY, v); else sessionStorage.removeItem(KEY); },
};

function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) {
    if (v === undefined || v === null || v === "") continue;
    for (const item of Array.isArray(v) ? v : [v]) q.append(k, String(item));
  }
  const s = q.toString();
  return s ? `?${s}` : "";
}

export async function call(method, path, params, key = session.key) {
  let resp;
  try {
    resp = await fetch(path + query(params), {
      method,
      headers: { Authorization: `Bearer ${key}`, Accept: "application/json" },
      cache: "no-store",
      credentials: "omit",
    });
  } catch (e) {
    throw new ApiError(0, "network_error",
      `Cannot reach the control plane at ${location.origin} (${e.message}). Is \`pilldrops up\` still running?`);
  }
  let body = null;
  try { body = await resp.json(); } catch { body = null; }
  if (!resp.ok) {
    const err = (body && body.error) || {};
    throw new ApiError(resp.status, err.code || `http_${resp.status}`,
      err.message || `${method} ${path} answered ${resp.status}`, err.request_id);
  }
  return body;
}

export const api = {
  whoami: (key) => call("GET", "/v1/whoami", null, key),
  usage: () => call("GET", "/v1/usage"),
  live: () => call("GET", "/v1/sandboxes",
    { state: ["pending", "starting", "running", "pausing", "paused", "resuming", "stopping"], limit: 500 }),
  history: (filter, limit) => call("GET", "/v1/history", { ...filter, limit }),
  stats: (filter) => call("GET", "/v1/history/stats", { ...filter, buckets: 60, bins: 20 }),
  nodes: () => call("GET", "/v1/nodes"),
  pools: () => call("GET", "/v1/pools"),
  kill: (id) => call("DELETE", `/v1/sandboxes/${encodeURIComponent(id)}`),
  pause: (id) => call("POST", `/v1/sandboxes/${encodeURIComponent(id)}/pause`),
  resume: (id) => call("POST", `/v1/sandboxes/${encodeURIComponent(id)}/resume`),
};
