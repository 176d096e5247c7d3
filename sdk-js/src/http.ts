/**
 * The HTTP client under every sandbox: retries with backoff (honouring `Retry-After`), typed errors, and
 * the one place where `fetch` failures become PillDrops errors — no raw `fetch` error reaches the caller.
 */
import { randomUUID } from 'node:crypto'

import type { ClientConfig, ConnectionOptions } from './config.js'
import { resolveConfig } from './config.js'
import {
  AbortError, AuthenticationError, InvalidRequest, PayloadTooLarge, PillDropsError, RequestTimeout, ServerError, TransportError, fromWire,
} from './errors.js'
import { RetryPolicy, parseRetryAfter } from './retry.js'
import { VERSION } from './version.js'

export const USER_AGENT = `pilldrops-js/${VERSION}`
/** The most a JSON answer of the control plane may be. */
export const MAX_JSON_BYTES = 32 * 1024 * 1024
/** The most of an error body that is read. */
const MAX_ERROR_BYTES = 64 * 1024

/** Where a request goes: a base URL and the auth headers that base URL wants. */
export interface Target {
  baseUrl: string
  headers: Record<string, string>
}

export type Params = [string, string][]
/** A request body, made fresh for every attempt (a stream can be sent only once). */
export type BodyFactory = () => BodyInit | Uint8Array | Promise<BodyInit | Uint8Array>

export interface RequestOptions {
  idempotent: boolean
  target?: Target
  params?: Params
  json?: unknown
  body?: BodyFactory
  headers?: Record<string, string>
  /** Seconds for the whole call (default: the client's `requestTimeout`). */
  timeout?: number
  /** Seconds of waiting for capacity (503 capacity_unavailable / 429) a create may spend; null: ordinary retries. */
  capacityWait?: number | null
  signal?: AbortSignal
  /** Most bytes of the answer that are read (default {@link MAX_JSON_BYTES}). */
  maxBytes?: number
  /** For {@link APIClient.json}: what the answer must look like (else it is a `ServerError`). */
  expect?: Shape
}

/** The keys a JSON answer must have; `items` (when given) must be an array of objects with `itemKeys`. */
export interface Shape {
  keys: readonly string[]
  itemKeys?: readonly string[]
}

function hasKeys(v: unknown, keys: readonly string[]): boolean {
  return typeof v === 'object' && v !== null && !Array.isArray(v) &&
    keys.every((k) => (v as Record<string, unknown>)[k] !== undefined)
}

/** Whether a decoded answer has the expected shape. */
export function matches(value: unknown, shape: Shape): boolean {
  if (!hasKeys(value, shape.keys)) return false
  if (!shape.itemKeys) return true
  const items = (value as { items?: unknown }).items
  return Array.isArray(items) && items.every((i) => hasKeys(i, shape.itemKeys!))
}

export interface StreamOptions extends Omit<RequestOptions, 'maxBytes' | 'capacityWait'> {}

/** A read 2xx answer. */
export interface Answer {
  status: number
  headers: Headers
  body: Uint8Array
  url: string
}

// Error codes (on `fetch`'s cause) meaning the request never left this process: safe to resend anything.
const NOT_SENT = new Set(['ECONNREFUSED', 'ENOTFOUND', 'EAI_AGAIN', 'UND_ERR_CONNECT_TIMEOUT', 'EHOSTUNREACH',
  'ENETUNREACH', 'EADDRNOTAVAIL'])

const TIMEOUT = Symbol('pilldrops.timeout')

/** An attempt's abort controller: fires on the caller's signal or on the deadline. */
class Attempt {
  readonly controller = new AbortController()
  private timer: ReturnType<typeof setTimeout> | undefined
  private readonly onAbort: () => void

  constructor(readonly signal: AbortSignal | undefined, timeoutS: number | null) {
    this.onAbort = () => this.controller.abort(signal?.reason)
    if (signal?.aborted) this.controller.abort(signal.reason)
    else signal?.addEventListener('abort', this.onAbort, { once: true })
    if (timeoutS !== null) this.arm(timeoutS)
  }

  arm(timeoutS: number): void {
    this.disarm()
    this.timer = setTimeout(() => this.controller.abort(TIMEOUT), Math.max(0, timeoutS * 1000))
  }

  disarm(): void {
    if (this.timer !== undefined) clearTimeout(this.timer)
    this.timer = undefined
  }

  get timedOut(): boolean {
    return this.controller.signal.aborted && this.controller.signal.reason === TIMEOUT
  }

  done(): void {
    this.disarm()
    this.signal?.removeEventListener('abort', this.onAbort)
  }
}

function errCode(err: unknown): string | undefined {
  let e: unknown = err
  for (let i = 0; i < 4 && e && typeof e === 'object'; i++) {
    const code = (e as { code?: unknown }).code
    if (typeof code === 'string') return code
    e = (e as { cause?: unknown }).cause
  }
  return undefined
}

/**
 * Translate anything `fetch` (or reading its body) throws into a PillDrops error: the caller's abort is
 * {@link AbortError}, the deadline {@link RequestTimeout}, anything else {@link TransportError}.
 */
export function mapFetchError(err: unknown, url: string, attempt?: Attempt): PillDropsError {
  if (err instanceof PillDropsError) return err
  const where = url.split('?', 1)[0]
  if (attempt?.signal?.aborted) {
    return new AbortError(`request to ${where} was aborted`, { cause: attempt.signal.reason })
  }
  if (attempt?.timedOut) return new RequestTimeout(`request to ${where} timed out`, { cause: err })
  const code = errCode(err)
  if (code === 'ERR_INVALID_URL') return new InvalidRequest(`invalid URL: ${where}`, { cause: err })
  const detail = err instanceof Error ? (err.cause instanceof Error ? err.cause.message : err.message) : String(err)
  const message = code === 'ECONNREFUSED'   // nothing listens there: say what usually fixes it
    ? `cannot reach PillDrops at ${where} — is \`pilldrops up\` running? (or set PILLDROPS_API_URL) [${detail}]`
    : `could not reach PillDrops at ${where}: ${code ? `${code}: ` : ''}${detail}`
  const out = new TransportError(message, { cause: err })
  out.notSent = code !== undefined && NOT_SENT.has(code)
  return out
}

/** Read a body fully, at most `max` bytes (more is {@link PayloadTooLarge}); read errors are mapped. */
export async function readCapped(res: Response, max: number, url: string, attempt?: Attempt,
                                 truncate = false): Promise<Uint8Array> {
  if (!res.body) return new Uint8Array(0)
  const reader = res.body.getReader()
  const parts: Uint8Array[] = []
  let size = 0
  try {
    for (;;) {
      const { done, value } = await reader.read()
      if (done) break
      if (size + value.byteLength > max) {
        if (truncate) {
          parts.push(value.subarray(0, max - size))
          size = max
          break
        }
        throw new PayloadTooLarge(`the answer from ${url.split('?', 1)[0]} is larger than ${max} bytes`)
      }
      parts.push(value)
      size += value.byteLength
    }
  } catch (err) {
    throw mapFetchError(err, url, attempt)
  } finally {
    reader.cancel().catch(() => {})
  }
  return concat(parts, size)
}

export function concat(parts: Uint8Array[], size?: number): Uint8Array {
  const total = size ?? parts.reduce((n, p) => n + p.byteLength, 0)
  const out = new Uint8Array(total)
  let at = 0
  for (const p of parts) {
    out.set(p, at)
    at += p.byteLength
  }
  return out
}

async function errorFromResponse(res: Response, url: string, attempt: Attempt): Promise<PillDropsError> {
  let raw: Uint8Array
  try {
    raw = await readCapped(res, MAX_ERROR_BYTES, url, attempt, true)
  } catch (err) {
    if (err instanceof AbortError) return err
    raw = new Uint8Array(0)
  }
  const text = new TextDecoder().decode(raw)
  const requestId = res.headers.get('x-request-id')
  let body: unknown = null
  try {
    body = JSON.parse(text)
  } catch {
    body = null
  }
  const ok = typeof body === 'object' && body !== null && typeof (body as { error?: unknown }).error === 'object'
  if (!ok) {
    const head = `HTTP ${res.status} ${res.statusText}`.trim()
    const snippet = text.slice(0, 200).trim()
    body = { error: { message: snippet ? `${head}: ${snippet}` : head, request_id: requestId } }
  }
  const err = fromWire(res.status, body)
  if (err.requestId === null) err.requestId = requestId
  return err
}

function sleep(seconds: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(new AbortError('aborted while waiting to retry', { cause: signal.reason }))
      return
    }
    const onAbort = () => {
      clearTimeout(timer)
      reject(new AbortError('aborted while waiting to retry', { cause: signal?.reason }))
    }
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort)
      resolve()
    }, seconds * 1000)
    signal?.addEventListener('abort', onAbort, { once: true })
  })
}

/** Test hook: the wait between attempts. */
export const timing = { sleep }

/**
 * Sends requests for one (apiUrl, apiKey). Retries idempotent calls on transport errors and
 * 429/500/502/503 with exponential backoff and jitter (honouring `Retry-After`); with `capacityWait` it
 * retries capacity errors for up to that many seconds of waiting instead.
 */
export class APIClient {
  constructor(readonly config: ClientConfig) {}

  /** What `console.log(client)` shows: never the API key. */
  [Symbol.for('nodejs.util.inspect.custom')](): string {
    return `<APIClient ${this.config.apiUrl}>`
  }

  static fromOptions(opts: ConnectionOptions = {}): APIClient {
    return new APIClient(resolveConfig(opts))
  }

  get control(): Target {
    return { baseUrl: this.config.apiUrl, headers: { Authorization: `Bearer ${this.config.apiKey}` } }
  }

  private url(target: Target, path: string, params?: Params): string {
    const qs = params && params.length ? `?${new URLSearchParams(params).toString()}` : ''
    return target.baseUrl.replace(/\/+$/, '') + path + qs
  }

  private async init(method: string, target: Target, opts: StreamOptions, signal: AbortSignal): Promise<RequestInit> {
    const headers: Record<string, string> = { 'User-Agent': USER_AGENT, ...target.headers, ...(opts.headers ?? {}) }
    let body: BodyInit | undefined
    if (opts.json !== undefined) {
      body = JSON.stringify(opts.json)
      headers['Content-Type'] = 'application/json'
    } else if (opts.body) {
      body = (await opts.body()) as BodyInit
    }
    const init: RequestInit & { duplex?: string } = { method, headers, body, signal, redirect: 'manual' }
    if (body && typeof body === 'object' && 'getReader' in body) init.duplex = 'half'
    return init
  }

  /** One attempt: the response with headers in, or a mapped error (non-2xx answers become typed errors). */
  private async attempt(method: string, path: string, opts: StreamOptions, attempt: Attempt,
                        target: Target): Promise<Response> {
    const url = this.url(target, path, opts.params)
    let res: Response
    try {
      res = await this.config.fetch(url, await this.init(method, target, opts, attempt.controller.signal))
    } catch (err) {
      throw mapFetchError(err, url, attempt)
    }
    if (res.status >= 400 || (res.status >= 300 && res.status < 400)) {
      const err = await errorFromResponse(res, url, attempt)
      if (err instanceof AuthenticationError && target.headers.Authorization) {
        err.message += ` (API key from ${this.config.keySource})`
      }
      err.retryAfter = parseRetryAfter(res.headers.get('retry-after'))
      throw err
    }
    return res
  }

  private async loop<T>(method: string, path: string, opts: StreamOptions & { capacityWait?: number | null },
                        timeoutS: number | null, once: (res: Response, a: Attempt, url: string) => Promise<T>,
                        keepAttempt = false): Promise<[T, Attempt]> {
    const target = opts.target ?? this.control
    const policy = new RetryPolicy(this.config.maxRetries, opts.idempotent, opts.capacityWait ?? null)
    for (;;) {
      const a = new Attempt(opts.signal, timeoutS)
      try {
        const res = await this.attempt(method, path, opts, a, target)
        const out = await once(res, a, this.url(target, path, opts.params))
        if (!keepAttempt) a.done()
        return [out, a]
      } catch (err) {
        a.done()
        const e = err instanceof PillDropsError ? err : mapFetchError(err, path, a)
        if (e instanceof AbortError) throw e
        const delay = policy.nextDelay(e, e.retryAfter)
        if (delay === null) throw e
        await timing.sleep(delay, opts.signal)
      }
    }
  }

  /** Send one logical request (retried as allowed) and return the 2xx answer, body read (bounded). */
  async request(method: string, path: string, opts: RequestOptions): Promise<Answer> {
    const timeoutS = opts.timeout ?? this.config.requestTimeout
    const max = opts.maxBytes ?? MAX_JSON_BYTES
    const [answer] = await this.loop(method, path, opts, timeoutS, async (res, a, url) => ({
      status: res.status, headers: res.headers, body: await readCapped(res, max, url, a), url,
    }))
    return answer
  }

  /** Send and parse a JSON answer; a malformed one is a {@link ServerError}. */
  async json<T>(method: string, path: string, opts: RequestOptions): Promise<T> {
    const answer = await this.request(method, path, opts)
    let value: unknown
    try {
      value = JSON.parse(new TextDecoder().decode(answer.body))
    } catch (err) {
      throw new ServerError(`unexpected response from ${path}: ${(err as Error).message}`)
    }
    if (opts.expect && !matches(value, opts.expect)) {
      throw new ServerError(`unexpected response from ${path}: ${new TextDecoder().decode(answer.body.subarray(0, 200))}`)
    }
    return value as T
  }

  /**
   * Like {@link request} but returns the response unread, for streaming its body. Only opening the stream
   * is retried and bounded by `requestTimeout`; reading it has no deadline (long commands are never cut)
   * but still ends on the caller's signal. Read it with {@link StreamReader}.
   */
  async stream(method: string, path: string, opts: StreamOptions): Promise<StreamReader> {
    const timeoutS = opts.timeout ?? this.config.requestTimeout
    const [[res, url], a] = await this.loop(method, path, opts, timeoutS,
      async (r, _a, u) => [r, u] as const, true)
    a.disarm()
    return new StreamReader(res, url, a)
  }
}

/** Reads a streamed answer; every read error is mapped; `close()` releases the connection. */
export class StreamReader {
  constructor(private readonly res: Response, readonly url: string, private readonly attempt: Attempt) {}

  async *chunks(): AsyncGenerator<Uint8Array> {
    const body = this.res.body
    if (!body) return
    const reader = body.getReader()
    // The caller's abort ends a pending read at once (and closes the stream, so the node stops the command).
    const signal = this.attempt.controller.signal
    const onAbort = () => { reader.cancel(signal.reason).catch(() => {}) }
    signal.addEventListener('abort', onAbort, { once: true })
    try {
      for (;;) {
        if (signal.aborted) throw mapFetchError(signal.reason, this.url, this.attempt)
        let r: ReadableStreamReadResult<Uint8Array>
        try {
          r = await reader.read()
        } catch (err) {
          throw mapFetchError(err, this.url, this.attempt)
        }
        if (signal.aborted) throw mapFetchError(signal.reason, this.url, this.attempt)
        if (r.done) return
        yield r.value
      }
    } finally {
      signal.removeEventListener('abort', onAbort)
      reader.cancel().catch(() => {})
      reader.releaseLock()
    }
  }

  /** NDJSON lines (without the newline); a line longer than `maxLine` bytes is a {@link ServerError}. */
  async *lines(maxLine: number): AsyncGenerator<string> {
    const decoder = new TextDecoder()
    let pending: Uint8Array[] = []
    let pendingSize = 0
    for await (const chunk of this.chunks()) {
      let start = 0
      for (;;) {
        const nl = chunk.indexOf(10, start)
        const end = nl === -1 ? chunk.byteLength : nl
        const piece = chunk.subarray(start, end)
        if (pendingSize + piece.byteLength > maxLine) {
          throw new ServerError(`a streamed line from ${this.url.split('?', 1)[0]} is longer than ${maxLine} bytes`)
        }
        if (piece.byteLength) {
          pending.push(piece)
          pendingSize += piece.byteLength
        }
        if (nl === -1) break
        yield decoder.decode(concat(pending, pendingSize))
        pending = []
        pendingSize = 0
        start = nl + 1
      }
    }
    if (pendingSize) yield decoder.decode(concat(pending, pendingSize))
  }

  close(): void {
    this.attempt.done()
    this.res.body?.cancel().catch(() => {})
  }
}

/** A sandbox's data plane: the node directly when its address and token are known, else the control plane. */
export function dataTarget(info: { envdUrl?: string | null; accessToken?: string | null }, client: APIClient): Target {
  if (info.envdUrl && info.accessToken) return { baseUrl: info.envdUrl, headers: { 'X-Access-Token': info.accessToken } }
  return client.control
}

export function sandboxPath(id: string, suffix = ''): string {
  return `/v1/sandboxes/${encodeURIComponent(id)}${suffix}`
}

/** A path inside the sandbox must be absolute; anything else is an {@link InvalidRequest} before any I/O. */
export function checkRemotePath(path: unknown, what = 'path'): string {
  if (typeof path !== 'string' || !path.startsWith('/')) {
    throw new InvalidRequest(`${what} ${JSON.stringify(path)} is not absolute: paths inside the sandbox must be ` +
      `absolute (start with '/'), e.g. ${JSON.stringify(`/home/user/${String(path || 'file')}`)}`)
  }
  return path
}

export function newIdempotencyKey(): string {
  return `pd-${randomUUID().replace(/-/g, '')}`
}
