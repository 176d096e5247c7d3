/** A scripted `fetch` for unit tests: every call is recorded and answered by the next matching handler. */
import { timing } from '../../src/http.js'

export interface Call {
  method: string
  url: URL
  headers: Headers
  body: string
  signal: AbortSignal | null | undefined
}

export type Handler = (call: Call) => Response | Promise<Response>

export class FakeFetch {
  readonly calls: Call[] = []
  private readonly routes: { method: string; path: string | RegExp; handler: Handler }[] = []

  on(method: string, path: string | RegExp, handler: Handler): this {
    this.routes.push({ method, path, handler })
    return this
  }

  /** Answer the next calls in order with these handlers, then fall through to the others. */
  queue(method: string, path: string | RegExp, ...handlers: Handler[]): this {
    let i = 0
    this.routes.unshift({
      method, path, handler: (c) => {
        const h = handlers[Math.min(i, handlers.length - 1)]!
        i += 1
        return h(c)
      },
    })
    return this
  }

  readonly fetch = async (input: string | URL | Request, init: RequestInit = {}): Promise<Response> => {
    const url = new URL(String(input))
    let body = ''
    if (typeof init.body === 'string') body = init.body
    else if (init.body instanceof Uint8Array) body = new TextDecoder().decode(init.body)
    else if (init.body && typeof (init.body as ReadableStream).getReader === 'function') {
      body = await new Response(init.body as ReadableStream).text()
    }
    const call: Call = { method: init.method ?? 'GET', url, headers: new Headers(init.headers), body, signal: init.signal }
    this.calls.push(call)
    if (init.signal?.aborted) throw init.signal.reason
    const route = this.routes.find((r) => r.method === call.method &&
      (typeof r.path === 'string' ? r.path === url.pathname : r.path.test(url.pathname)))
    if (!route) return json(404, { error: { code: 'not_found', message: `no route ${call.method} ${url.pathname}` } })
    return route.handler(call)
  }

  paths(): string[] {
    return this.calls.map((c) => `${c.method} ${c.url.pathname}`)
  }
}

export function json(status: number, body: unknown, headers: Record<string, string> = {}): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'content-type': 'application/json', ...headers } })
}

export function wireInfo(id: string, extra: Record<string, unknown> = {}): Record<string, unknown> {
  return {
    id, template: 'base', state: 'running', vcpu: 1, memory_mb: 512, timeout: 300, metadata: {},
    created_at: '2026-01-01T00:00:00Z', vcpu_s: 0, gb_s: 0, storage_gb_s: 0, cost_usd: 0,
    envd_url: 'http://node.test:1', access_token: `tok-${id}`, ...extra,
  }
}

/** A connection refused, as undici reports it. */
export function refused(): never {
  const cause = Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:1'), { code: 'ECONNREFUSED' })
  throw new TypeError('fetch failed', { cause })
}

/** A connection reset after the request was sent. */
export function reset(): never {
  const cause = Object.assign(new Error('other side closed'), { code: 'UND_ERR_SOCKET' })
  throw new TypeError('fetch failed', { cause })
}

/** Record the retry waits instead of sleeping. */
export function recordSleeps(): { delays: number[]; restore(): void } {
  const original = timing.sleep
  const delays: number[] = []
  timing.sleep = async (s: number) => {
    delays.push(s)
  }
  return { delays, restore: () => { timing.sleep = original } }
}

export function ndjson(events: unknown[], split = 0): Response {
  const text = events.map((e) => JSON.stringify(e)).join('\n') + '\n'
  const bytes = new TextEncoder().encode(text)
  const parts: Uint8Array[] = []
  if (split > 0) for (let i = 0; i < bytes.length; i += split) parts.push(bytes.subarray(i, i + split))
  else parts.push(bytes)
  return new Response(new ReadableStream({
    start(c) {
      for (const p of parts) c.enqueue(p)
      c.close()
    },
  }), { status: 200, headers: { 'content-type': 'application/x-ndjson' } })
}

export function b64(s: string | Uint8Array): string {
  return Buffer.from(s).toString('base64')
}

export const OPTS = { apiUrl: 'http://cp.test', apiKey: 'pd_test_key' }
