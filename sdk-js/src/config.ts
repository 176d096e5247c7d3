/**
 * Where the SDK finds the API URL and key, exactly like the Python SDK and the CLI:
 * the URL: explicit option > `PILLDROPS_API_URL` > the config file that `pilldrops up` writes
 * (`$XDG_CONFIG_HOME/pilldrops/config.json`, default `~/.config/pilldrops/config.json`, holding
 * `{"api_url", "api_key"}`) > `http://127.0.0.1:7070`; the key: explicit option > `PILLDROPS_API_KEY` > the
 * config file > `E2B_API_KEY`. An authentication error names where the key came from.
 */
import { readFileSync } from 'node:fs'
import { homedir } from 'node:os'
import { join } from 'node:path'

import { AuthenticationError, InvalidRequest } from './errors.js'

/** Environment variables (`process.env` by default). */
export type Env = Record<string, string | undefined>

export const DEFAULT_API_URL = 'http://127.0.0.1:7070'
export const DEFAULT_REQUEST_TIMEOUT_S = 60
export const DEFAULT_MAX_RETRIES = 3

const NO_KEY_MESSAGE =
  'no PillDrops API key found: run `pilldrops up` (it saves one to the config file) or set PILLDROPS_API_KEY'

/** Connection options every call accepts. */
export interface ConnectionOptions {
  /** The control plane's URL (default: `PILLDROPS_API_URL`, the config file, then `http://127.0.0.1:7070`). */
  apiUrl?: string
  /** The API key (default: `PILLDROPS_API_KEY`, then the config file, then `E2B_API_KEY`). */
  apiKey?: string
  /** Seconds each non-streaming HTTP call may take (default 60). */
  requestTimeout?: number
  /** Retries of a failed idempotent call (default 3). */
  maxRetries?: number
  /** A `fetch` implementation (default: the global one). For tests and custom agents. */
  fetch?: typeof globalThis.fetch
}

export interface ClientConfig {
  apiUrl: string
  apiKey: string
  /** Where the key came from (named in authentication errors). */
  keySource: string
  requestTimeout: number
  maxRetries: number
  fetch: typeof globalThis.fetch
}

export function configPath(env: Env = process.env): string {
  const base = env.XDG_CONFIG_HOME || join(homedir(), '.config')
  return join(base, 'pilldrops', 'config.json')
}

/** The CLI's config file as `{api_url?, api_key?}` (missing or malformed: empty). */
export function loadConfigFile(env: Env = process.env): { api_url?: string; api_key?: string } {
  let data: unknown
  try {
    data = JSON.parse(readFileSync(configPath(env), 'utf8'))
  } catch {
    return {}
  }
  if (typeof data !== 'object' || data === null || Array.isArray(data)) return {}
  const out: { api_url?: string; api_key?: string } = {}
  const rec = data as Record<string, unknown>
  if (typeof rec.api_url === 'string') out.api_url = rec.api_url
  if (typeof rec.api_key === 'string') out.api_key = rec.api_key
  return out
}

function positive(value: number | undefined, fallback: number, what: string): number {
  if (value === undefined) return fallback
  if (typeof value !== 'number' || !Number.isFinite(value) || value <= 0) {
    throw new InvalidRequest(`${what} must be a positive number of seconds, got ${String(value)}`)
  }
  return value
}

/** Resolve every setting; throws {@link AuthenticationError} when no key is found anywhere. */
export function resolveConfig(opts: ConnectionOptions = {}, env: Env = process.env): ClientConfig {
  let file: ReturnType<typeof loadConfigFile> | undefined
  const fromFile = () => (file ??= loadConfigFile(env))
  // explicit > PILLDROPS_API_KEY > the saved config file > E2B_API_KEY (the CLI's and the Python SDK's order)
  const found: [string | undefined, string][] = [
    [opts.apiKey, 'the apiKey option'], [env.PILLDROPS_API_KEY, '$PILLDROPS_API_KEY'],
    [fromFile().api_key, `the config file ${configPath(env)}`], [env.E2B_API_KEY, '$E2B_API_KEY'],
  ]
  const [apiKey, keySource] = found.find(([k]) => k) ?? [undefined, '']
  if (!apiKey) throw new AuthenticationError(NO_KEY_MESSAGE)
  const apiUrl = (opts.apiUrl || env.PILLDROPS_API_URL || fromFile().api_url || DEFAULT_API_URL).replace(/\/+$/, '')
  try {
    const u = new URL(apiUrl)
    if (u.protocol !== 'http:' && u.protocol !== 'https:') throw new Error(u.protocol)
  } catch {
    throw new InvalidRequest(`invalid API URL ${JSON.stringify(apiUrl)}: an http:// or https:// URL is required`)
  }
  const maxRetries = opts.maxRetries ?? DEFAULT_MAX_RETRIES
  if (!Number.isInteger(maxRetries) || maxRetries < 0) {
    throw new InvalidRequest(`maxRetries must be an integer >= 0, got ${String(maxRetries)}`)
  }
  const f = opts.fetch ?? globalThis.fetch
  if (typeof f !== 'function') throw new InvalidRequest('no fetch available: Node.js >= 18 is required')
  return {
    apiUrl,
    apiKey,
    keySource,
    requestTimeout: positive(opts.requestTimeout, DEFAULT_REQUEST_TIMEOUT_S, 'requestTimeout'),
    maxRetries,
    fetch: f,
  }
}
