/** Query parameters and local validation of request arguments (an `InvalidRequest` before any I/O). */
import { InvalidRequest } from './errors.js'
import type { Params } from './http.js'
import { SANDBOX_STATES } from './wire.js'
import type { SandboxState } from './wire.js'

export type StateFilter = SandboxState | SandboxState[] | string | string[]
export type TimeArg = Date | string

/** One state or several, checked against the known states. */
export function stateValues(state: StateFilter | undefined): string[] {
  const states = state === undefined ? [] : Array.isArray(state) ? state : [state]
  for (const s of states) {
    if (!(SANDBOX_STATES as readonly string[]).includes(s)) {
      throw new InvalidRequest(`unknown sandbox state ${JSON.stringify(s)}; valid states: ${SANDBOX_STATES.join(', ')}`)
    }
  }
  return [...states]
}

/** Query parameters of `GET /v1/sandboxes` (`state` repeats, metadata is `metadata.<k>=<v>`). */
export function listParams(state: StateFilter | undefined, metadata: Record<string, string> | undefined,
                           limit: number, cursor: string | null): Params {
  const params: Params = stateValues(state).map((s) => ['state', s])
  for (const [k, v] of Object.entries(metadata ?? {})) params.push([`metadata.${k}`, v])
  params.push(['limit', String(limit)])
  if (cursor) params.push(['cursor', cursor])
  return params
}

const ISO = /^\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?)?$/i

/**
 * A time query parameter as ISO 8601 UTC (`...Z`). A `Date`, or a string in ISO 8601 (`2025-01-31`,
 * `2025-01-31T12:00`, `...+02:00`, `...Z`); a string without a zone is UTC (as in the Python SDK).
 */
export function isoParam(value: TimeArg | undefined, what: string): string | undefined {
  if (value === undefined) return undefined
  let date: Date
  if (value instanceof Date) {
    date = value
  } else if (typeof value === 'string') {
    const v = value.trim()
    const m = ISO.exec(v)
    if (!m) throw new InvalidRequest(`${what} must be an ISO 8601 date or time, got ${JSON.stringify(value)}`)
    const hasTime = v.length > 10
    date = new Date(hasTime && !m[1] ? `${v.replace(' ', 'T')}Z` : v.replace(' ', 'T'))
  } else {
    throw new InvalidRequest(`${what} must be a Date or an ISO 8601 string`)
  }
  if (Number.isNaN(date.getTime())) throw new InvalidRequest(`${what} is not a valid time: ${String(value)}`)
  return date.toISOString()
}

export function periodParams(since: TimeArg | undefined, until: TimeArg | undefined): Params {
  const out: Params = []
  const s = isoParam(since, 'since')
  const u = isoParam(until, 'until')
  if (s) out.push(['since', s])
  if (u) out.push(['until', u])
  return out
}

export function checkLimit(limit: number | undefined, what = 'limit'): void {
  if (limit !== undefined && (!Number.isInteger(limit) || limit < 1)) {
    throw new InvalidRequest(`${what} must be a positive integer, got ${String(limit)}`)
  }
}

function num(value: unknown, what: string, lo: number, hi: number, integer: boolean, loOpen = false): void {
  const ok = typeof value === 'number' && Number.isFinite(value) && (loOpen ? value > lo : value >= lo) &&
    value <= hi && (!integer || Number.isInteger(value))
  if (!ok) {
    throw new InvalidRequest(`invalid ${what}: must be ${integer ? 'an integer' : 'a number'} in ` +
      `${loOpen ? '(' : '['}${lo}, ${hi}], got ${JSON.stringify(value)}`, { details: [{ loc: [what] }] })
  }
}

function stringMap(value: unknown, what: string, env: boolean): Record<string, string> {
  if (value === undefined || value === null) return {}
  if (typeof value !== 'object' || Array.isArray(value)) throw new InvalidRequest(`invalid ${what}: must be an object`)
  for (const [k, v] of Object.entries(value)) {
    if (typeof v !== 'string') throw new InvalidRequest(`invalid ${what}: the value of ${JSON.stringify(k)} is not a string`)
    if (env && (!k || k.includes('=') || k.includes('\0'))) {
      throw new InvalidRequest(`invalid ${what}: invalid environment variable name ${JSON.stringify(k)}`)
    }
  }
  return value as Record<string, string>
}

/** A sandbox's spec. */
export interface SpecArgs {
  /** Template name (default `base`). */
  template?: string
  /** CPU quota in cores (default 1). */
  vcpu?: number
  /** Memory limit in MiB (default 512). */
  memoryMb?: number
  /**
   * Size of the writable layer in MiB: writes past it fail with ENOSPC inside the sandbox (default: the
   * template's, else the deployment's, 10240; past the deployment's maximum: `InvalidRequest`). Sent only
   * when given. `info().diskUsedBytes` is what it holds.
   */
  diskMb?: number
  /** Seconds until the sandbox is killed (default 300, max 86400); extend with `setTimeout`. */
  timeout?: number
  /** Free-form labels, filterable in `Sandbox.list` / `Sandbox.history`. */
  metadata?: Record<string, string>
  /** Environment variables for every command. */
  envs?: Record<string, string>
  /**
   * `container` (crun, the shared host kernel), `gvisor` (a user-space kernel between the sandbox and the
   * host) or `microvm` (its own guest kernel under QEMU); default: the template's, else the deployment's
   * (`container`). Sent only when given.
   */
  isolation?: string
  /** Ports served by URL (`getUrl`) without a token. */
  publicPorts?: number[]
  /** Every port is served by URL without a token (default false). */
  public?: boolean
  /**
   * Egress to the internet (NAT through the node, DNS through its resolver). Default: the template's
   * `[network]`, else none (loopback only). Sent only when given.
   */
  allowInternetAccess?: boolean
  /**
   * `allowOut`: IPv4 CIDRs or addresses always reachable (even without `allowInternetAccess`); `denyOut`: never
   * reachable unless also in `allowOut` (allow wins). The node itself, other sandboxes and 169.254.0.0/16 are
   * never reachable. Sent only when given.
   */
  network?: NetworkPolicy
}

/** Where a sandbox may connect to (besides its own loopback). */
export interface NetworkPolicy {
  allowOut?: string[]
  denyOut?: string[]
}

const CIDR = /^(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})(\/(\d{1,2}))?$/

function cidrList(v: unknown, what: string): string[] {
  if (v === undefined) return []
  if (!Array.isArray(v) || v.length > 64) throw new InvalidRequest(`${what} must be a list of at most 64 IPv4 CIDRs`)
  for (const c of v) {
    const m = typeof c === 'string' ? CIDR.exec(c.trim()) : null
    if (!m || m.slice(1, 5).some((o) => Number(o) > 255) || (m[6] !== undefined && Number(m[6]) > 32)) {
      throw new InvalidRequest(`${what}: ${JSON.stringify(c)} is not an IPv4 address or CIDR`)
    }
  }
  return v as string[]
}

/** The isolation modes a sandbox can ask for. */
export const ISOLATION_MODES = ['container', 'gvisor', 'microvm'] as const

/** The wire body of a create, validated locally. */
export function createBody(spec: SpecArgs): Record<string, unknown> {
  const template = spec.template ?? 'base'
  if (typeof template !== 'string' || !/^[a-z0-9][a-z0-9._-]*$/.test(template) || template.length > 128) {
    throw new InvalidRequest(`invalid template: ${JSON.stringify(template)} (lowercase letters, digits, '.', '_', '-')`)
  }
  const body: Record<string, unknown> = {
    template, vcpu: spec.vcpu ?? 1, memory_mb: spec.memoryMb ?? 512, timeout: spec.timeout ?? 300,
    metadata: stringMap(spec.metadata, 'metadata', false), envs: stringMap(spec.envs, 'envs', true),
  }
  num(body.vcpu, 'vcpu', 0, 64, false, true)
  num(body.memory_mb, 'memoryMb', 16, 262_144, true)
  num(body.timeout, 'timeout', 1, 86_400, true)
  if (spec.diskMb !== undefined) {
    num(spec.diskMb, 'diskMb', 16, 4_194_304, true)
    body.disk_mb = spec.diskMb
  }
  if (spec.isolation !== undefined) {
    if (!(ISOLATION_MODES as readonly string[]).includes(spec.isolation)) {
      throw new InvalidRequest(`unknown isolation mode ${JSON.stringify(spec.isolation)}; valid modes: ${ISOLATION_MODES.join(', ')}`)
    }
    body.isolation = spec.isolation
  }
  if (spec.allowInternetAccess !== undefined) {
    if (typeof spec.allowInternetAccess !== 'boolean') throw new InvalidRequest('allowInternetAccess must be a boolean')
    body.allow_internet_access = spec.allowInternetAccess
  }
  if (spec.network !== undefined) {
    body.network = { allow_out: cidrList(spec.network.allowOut, 'network.allowOut'),
      deny_out: cidrList(spec.network.denyOut, 'network.denyOut') }
  }
  if (spec.publicPorts !== undefined) {
    if (!Array.isArray(spec.publicPorts)) throw new InvalidRequest('publicPorts must be an array of ports')
    for (const p of spec.publicPorts) num(p, 'publicPorts', 1, 65_535, true)
    body.public_ports = spec.publicPorts
  }
  if (spec.public !== undefined) body.public = Boolean(spec.public)
  return body
}

/** A port URL's request body, validated locally. */
export function portUrlBody(port: number, opts: { expiresIn?: number; path?: string }): Record<string, unknown> {
  num(port, 'port', 1, 65_535, true)
  const body: Record<string, unknown> = { port, expires_in: opts.expiresIn ?? 3600, path: opts.path ?? '/' }
  num(body.expires_in, 'expiresIn', 1, 7 * 86_400, true)
  if (typeof body.path !== 'string' || !/^\/[^\s#]*$/.test(body.path)) {
    throw new InvalidRequest(`invalid path ${JSON.stringify(body.path)}: it starts with / (no spaces or #)`)
  }
  return body
}

export function runTimeout(timeout: number | undefined): void {
  if (timeout !== undefined) num(timeout, 'timeout', 0, 86_400, false, true)
}

export function checkTimeoutSeconds(seconds: number): void {
  num(seconds, 'timeout', 1, 86_400, true)
}

export { stringMap }

/** Metadata for every sandbox, or a function of the item (or index) giving each its own. */
export type Metadata<T> = Record<string, string> | ((item: T) => Record<string, string> | null | undefined)

/** The metadata of one item's sandbox: the object, or what the function gives for the item (as strings). */
export function itemMetadata<T>(metadata: Metadata<T> | undefined, item: T): Record<string, string> {
  const got: unknown = typeof metadata === 'function' ? metadata(item) : metadata
  if (got === undefined || got === null) return {}
  if (typeof got !== 'object' || Array.isArray(got)) {
    throw new InvalidRequest(`metadata for item ${JSON.stringify(item)} must be an object, not ${typeof got}`)
  }
  return Object.fromEntries(Object.entries(got).map(([k, v]) => [k, String(v)]))
}
