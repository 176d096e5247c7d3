import assert from 'node:assert/strict'
import { afterEach, beforeEach, describe, test } from 'node:test'

import {
  AbortError, AuthenticationError, CapacityUnavailable, CommandFailed, EgressForbidden, InvalidRequest, InvalidState,
  NodeUnavailable, PayloadTooLarge, PermissionDenied, RequestTimeout, Sandbox, SandboxNotFound, ServerError, TransportError,
  SandboxInfo,
} from '../../src/index.js'
import { FakeFetch, OPTS, b64, json, ndjson, recordSleeps, refused, reset, wireInfo } from './fake.js'

let sleeps: ReturnType<typeof recordSleeps>
beforeEach(() => { sleeps = recordSleeps() })
afterEach(() => sleeps.restore())

function opts(f: FakeFetch, extra: Record<string, unknown> = {}) {
  return { ...OPTS, fetch: f.fetch, ...extra }
}

describe('create', () => {
  test('retries capacity errors honouring Retry-After, with one idempotency key for every attempt', async () => {
    const f = new FakeFetch().queue('POST', '/v1/sandboxes',
      () => json(503, { error: { code: 'capacity_unavailable', message: '0/1 nodes fit' } }, { 'retry-after': '2' }),
      () => json(429, { error: { code: 'rate_limited', message: 'slow down' } }, { 'retry-after': '1' }),
      () => refused(),
      () => json(201, wireInfo('sb_1')))
    const sb = await Sandbox.create({ ...opts(f), template: 'tiny', memoryMb: 256, metadata: { run: 'x' } })
    assert.equal(sb.id, 'sb_1')
    assert.equal(sb.info.memoryMb, 512)
    assert.equal(f.calls.length, 4)
    const keys = new Set(f.calls.map((c) => c.headers.get('idempotency-key')))
    assert.equal(keys.size, 1)
    assert.match([...keys][0]!, /^pd-[0-9a-f]{32}$/)
    assert.deepEqual(sleeps.delays.slice(0, 2), [2, 1])
    const body = JSON.parse(f.calls[0]!.body)
    assert.deepEqual(body, { template: 'tiny', vcpu: 1, memory_mb: 256, timeout: 300, metadata: { run: 'x' }, envs: {} })
    assert.equal(f.calls[0]!.headers.get('authorization'), 'Bearer pd_test_key')
    assert.match(f.calls[0]!.headers.get('user-agent')!, /^pilldrops-js\//)
    // a second logical create gets a new key
    f.queue('POST', '/v1/sandboxes', () => json(201, wireInfo('sb_2')))
    await Sandbox.create(opts(f))
    assert.notEqual(f.calls[4]!.headers.get('idempotency-key'), [...keys][0])
    // the isolation mode is sent only when given
    f.queue('POST', '/v1/sandboxes', () => json(201, wireInfo('sb_3')))
    await Sandbox.create({ ...opts(f), isolation: 'gvisor' })
    assert.equal(JSON.parse(f.calls[5]!.body).isolation, 'gvisor')
    assert.equal(JSON.parse(f.calls[5]!.body).disk_mb, undefined)
    // so is the disk size
    f.queue('POST', '/v1/sandboxes', () => json(201, { ...wireInfo('sb_4'), disk_mb: 64, disk_used_bytes: 4096 }))
    const disk = await Sandbox.create({ ...opts(f), diskMb: 64 })
    assert.equal(JSON.parse(f.calls[6]!.body).disk_mb, 64)
    assert.equal(disk.info.diskMb, 64)
    assert.equal(disk.info.diskUsedBytes, 4096)
    // egress: sent only when given, in the wire's snake_case; the typed 403 is EgressForbidden
    f.queue('POST', '/v1/sandboxes', () => json(201, wireInfo('sb_4')))
    await Sandbox.create({ ...opts(f), allowInternetAccess: true, network: { allowOut: ['198.18.0.1'], denyOut: ['10.0.0.0/8'] } })
    const eb = JSON.parse(f.calls[7]!.body)
    assert.equal(eb.allow_internet_access, true)
    assert.deepEqual(eb.network, { allow_out: ['198.18.0.1'], deny_out: ['10.0.0.0/8'] })
    assert.equal('allow_internet_access' in body, false)
    f.queue('POST', '/v1/sandboxes', () => json(403, { error: { code: 'egress_forbidden', message: 'no egress',
      details: { reason: 'disabled' } } }))
    const denied = await Sandbox.create({ ...opts(f), allowInternetAccess: true }).catch((e) => e)
    assert.ok(denied instanceof EgressForbidden && denied instanceof PermissionDenied)
    assert.equal(denied.code, 'egress_forbidden')
  })

  test('capacityWait bounds the waiting, then the capacity error is thrown', async () => {
    const f = new FakeFetch().on('POST', '/v1/sandboxes',
      () => json(503, { error: { code: 'capacity_unavailable', message: 'full' } }, { 'retry-after': '4' }))
    await assert.rejects(Sandbox.create(opts(f, { capacityWait: 10 })), CapacityUnavailable)
    assert.deepEqual(sleeps.delays, [4, 4, 2])
    const g = new FakeFetch().on('POST', '/v1/sandboxes',
      () => json(503, { error: { code: 'capacity_unavailable', message: 'full' } }))
    await assert.rejects(Sandbox.create(opts(g, { capacityWait: 0 })), CapacityUnavailable)
    assert.equal(g.calls.length, 1)
  })

  test('bad arguments are InvalidRequest before any request; server errors keep code and request id', async () => {
    const f = new FakeFetch().on('POST', '/v1/sandboxes', () =>
      json(401, { error: { code: 'unauthenticated', message: 'bad key' } }, { 'x-request-id': 'req-9' }))
    for (const bad of [{ template: 'Bad!' }, { vcpu: 0 }, { memoryMb: 1.5 }, { timeout: 90000 },
      { envs: { 'A=B': 'x' } }, { capacityWait: -1 }, { isolation: 'vm' }, { diskMb: 8 }, { diskMb: 64.5 },
      { network: { allowOut: ['nope'] } }, { network: { denyOut: ['10.0.0.0/33'] } }]) {
      await assert.rejects(Sandbox.create(opts(f, bad)), InvalidRequest)
    }
    assert.equal(f.calls.length, 0)
    const err = await Sandbox.create(opts(f)).catch((e) => e)
    assert.ok(err instanceof AuthenticationError)
    assert.equal(err.requestId, 'req-9')
    assert.match(err.message, /^bad key \(API key from the apiKey option\)$/)
    assert.equal(f.calls.length, 1, 'a 401 is not retried')
  })

  test('no raw fetch error leaks: refused, reset, non-JSON error bodies, malformed answers', async () => {
    const f = new FakeFetch().on('GET', '/v1/sandboxes/sb_1', () => refused())
    const e1 = await Sandbox.getInfo('sb_1', opts(f)).catch((e) => e)
    assert.ok(e1 instanceof TransportError && !(e1 instanceof TypeError))
    assert.match(e1.message, /cannot reach PillDrops at http:\/\/cp.test\/v1\/sandboxes\/sb_1 — is `pilldrops up` running\?/)
    assert.equal(f.calls.length, 4, 'idempotent: 3 retries')
    const g = new FakeFetch().on('GET', '/v1/sandboxes/sb_1',
      () => new Response('<html>bad gateway</html>', { status: 502, statusText: 'Bad Gateway' }))
    const e2 = await Sandbox.getInfo('sb_1', opts(g)).catch((e) => e)
    assert.ok(e2 instanceof NodeUnavailable)
    assert.match(e2.message, /HTTP 502 Bad Gateway: <html>bad gateway/)
    const h = new FakeFetch().on('GET', '/v1/sandboxes/sb_1', () => new Response('not json', { status: 200 }))
    await assert.rejects(Sandbox.getInfo('sb_1', opts(h)), ServerError)
    const bad = new FakeFetch().on('GET', '/v1/sandboxes', () => json(200, { items: [{ id: 'sb_1' }] }))
      .on('GET', '/v1/sandboxes/sb_1', () => json(200, [1, 2]))
    await assert.rejects(Sandbox.list(opts(bad)), ServerError, 'a malformed listing is a ServerError, not a TypeError')
    await assert.rejects(Sandbox.getInfo('sb_1', opts(bad)), ServerError)
    const k = new FakeFetch().on('GET', '/v1/sandboxes/sb_1', () => json(404, { error: { code: 'sandbox_not_found', message: 'no' } }))
    await assert.rejects(Sandbox.getInfo('sb_1', opts(k)), SandboxNotFound)
  })

  test('the client deadline is a RequestTimeout; the caller signal an AbortError', async () => {
    const hang = (c: { signal: AbortSignal | null | undefined }) => new Promise<Response>((_r, reject) => {
      c.signal!.addEventListener('abort', () => reject(new DOMException('aborted', 'AbortError')))
    })
    const f = new FakeFetch().on('GET', '/v1/sandboxes/sb_1', hang)
    const e = await Sandbox.getInfo('sb_1', opts(f, { requestTimeout: 0.05, maxRetries: 1 })).catch((x) => x)
    assert.ok(e instanceof RequestTimeout, String(e))
    assert.equal(f.calls.length, 2)
    const ac = new AbortController()
    const p = Sandbox.getInfo('sb_1', { ...opts(f), signal: ac.signal })
    setTimeout(() => ac.abort(new Error('user stop')), 20)
    const a = await p.catch((x) => x)
    assert.ok(a instanceof AbortError)
    assert.equal(a.name, 'AbortError')
    assert.equal((a.cause as Error).message, 'user stop')
  })
})

describe('a sandbox', () => {
  async function made(f: FakeFetch): Promise<Sandbox> {
    f.queue('POST', '/v1/sandboxes', () => json(201, wireInfo('sb_1')))
    return Sandbox.create(opts(f))
  }

  test('run streams NDJSON from the node directly with the access token, never the API key', async () => {
    const f = new FakeFetch()
    const sb = await made(f)
    const seen: string[] = []
    f.on('POST', '/v1/sandboxes/sb_1/run', () => ndjson([
      { type: 'start', pid: 7 },
      { type: 'stdout', data: b64('h\u00e9') },
      { type: 'stdout', data: b64(Buffer.from('llo \u20ac', 'utf8')) },
      { type: 'stderr', data: b64('warn') },
      { type: 'exit', exit_code: 3, duration: 0.5, truncated: false, timed_out: false },
    ], 5))
    const r = await sb.run(['python', '-c', 'x'], { onStdout: (t) => seen.push(t), envs: { A: '1' }, cwd: '/tmp', timeout: 5 })
    assert.equal(r.stdout, 'h\u00e9llo \u20ac')
    assert.equal(seen.join(''), 'h\u00e9llo \u20ac')
    assert.equal(r.stderr, 'warn')
    assert.equal(r.exitCode, 3)
    assert.equal(r.ok, false)
    assert.equal(r.pid, 7)
    assert.equal(r.duration, 0.5)
    const call = f.calls.at(-1)!
    assert.equal(call.url.origin, 'http://node.test:1')
    const { inspect } = await import('node:util')
    for (const shown of [inspect(sb), inspect(sb.client), inspect(sb.info), JSON.stringify(sb.info), String(sb)]) {
      assert.ok(!shown.includes('tok-sb_1') && !shown.includes('pd_test_key'), `a secret shown: ${shown}`)
    }
    assert.equal(sb.info.accessToken, 'tok-sb_1')
    assert.equal(call.headers.get('x-access-token'), 'tok-sb_1')
    assert.equal(call.headers.get('authorization'), null)
    assert.deepEqual(JSON.parse(call.body), { cmd: ['python', '-c', 'x'], envs: { A: '1' }, max_output_bytes: 16777216, cwd: '/tmp', timeout: 5 })
    await assert.rejects(sb.run('false', { check: true }), (e: unknown) => e instanceof CommandFailed &&
      (e.result as { exitCode: number }).exitCode === 3)
  })

  test('run output is capped client-side; error events are typed; a cut stream is a TransportError', async () => {
    const f = new FakeFetch()
    const sb = await made(f)
    f.queue('POST', '/v1/sandboxes/sb_1/run',
      () => ndjson([{ type: 'stdout', data: b64('x'.repeat(100)) }, { type: 'exit', exit_code: 0 }]),
      () => ndjson([{ type: 'error', code: 'invalid_state', message: 'paused' }]),
      () => ndjson([{ type: 'start', pid: 1 }]),
      () => ndjson([{ type: 'stdout', data: '***' }]),
      () => json(502, { error: { code: 'node_unavailable', message: 'node down' } }))
    const r = await sb.run('yes', { maxOutputBytes: 10 })
    assert.equal(r.stdout, 'x'.repeat(10))
    assert.equal(r.truncated, true)
    await assert.rejects(sb.run('x'), InvalidState)
    await assert.rejects(sb.run('x'), TransportError)
    await assert.rejects(sb.run('x'), ServerError)
    const runs = () => f.calls.filter((c) => c.url.pathname.endsWith('/run')).length
    const before = runs()
    await assert.rejects(sb.run('x'), NodeUnavailable)
    assert.equal(runs(), before + 1, 'a run is never resent once it may have started')
    f.queue('POST', '/v1/sandboxes/sb_1/run', () => reset())
    await assert.rejects(sb.run('x'), TransportError)
    assert.equal(runs(), before + 2)
    f.queue('POST', '/v1/sandboxes/sb_1/run', () => refused(), () => ndjson([{ type: 'exit', exit_code: 0 }]))
    assert.equal((await sb.run('x')).exitCode, 0, 'a refused connection (never sent) is retried')
    await assert.rejects(sb.run(''), InvalidRequest)
    await assert.rejects(sb.run('x', { maxOutputBytes: 0 }), InvalidRequest)
  })

  test('an AbortSignal ends a run mid-stream with AbortError', async () => {
    const f = new FakeFetch()
    const sb = await made(f)
    let cancelled = false
    f.on('POST', '/v1/sandboxes/sb_1/run', () => new Response(new ReadableStream({
      start(c) { c.enqueue(new TextEncoder().encode(JSON.stringify({ type: 'start', pid: 1 }) + '\n')) },
      cancel() { cancelled = true },
    }), { status: 200 }))
    const ac = new AbortController()
    const got: string[] = []
    const p = sb.run('sleep 100', { signal: ac.signal, onStdout: (t) => got.push(t) })
    setTimeout(() => ac.abort(), 30)
    await assert.rejects(p, AbortError)
    assert.equal(cancelled, true, 'the stream is closed, so the node kills the command')
  })

  test('a streamed line past the bound is refused instead of buffered', async () => {
    const f = new FakeFetch()
    const sb = await made(f)
    f.on('POST', '/v1/sandboxes/sb_1/run', () => new Response(new ReadableStream({
      pull(c) { c.enqueue(new Uint8Array(1 << 20).fill(65)) },
    })))
    await assert.rejects(sb.run('x'), (e: unknown) => e instanceof ServerError && /longer than/.test((e as Error).message))
  })

  test('files, lifecycle calls and await using', async () => {
    const f = new FakeFetch()
    const sb = await made(f)
    f.on('GET', '/v1/sandboxes/sb_1/files', (c) => c.url.searchParams.get('path') === '/big'
      ? new Response(new Uint8Array(2048)) : new Response('hello'))
    f.on('PUT', '/v1/sandboxes/sb_1/files', (c) => json(200, { name: 'x', path: c.url.searchParams.get('path'), type: 'file', size: Buffer.byteLength(c.body), mode: 420, mtime: 1 }))
    f.on('GET', '/v1/sandboxes/sb_1/files/list', (c) => c.url.searchParams.get('path') === '/tmp'
      ? json(200, { items: [{ name: 'x', path: '/tmp/x', type: 'file', size: 5, mode: 420, mtime: 1 }] })
      : json(404, { error: { code: 'file_not_found', message: 'no' } }))
    assert.equal(await sb.files.read('/tmp/x'), 'hello')
    await assert.rejects(sb.files.readBytes('/big', { maxBytes: 1024 }), PayloadTooLarge)
    const info = await sb.files.write('/tmp/x', 'héllo')
    assert.deepEqual([info.path, info.size], ['/tmp/x', 6])
    assert.equal(await sb.files.exists('/tmp/x'), true)
    assert.equal(await sb.files.exists('/tmp/./y'), false)
    assert.equal(await sb.files.exists('/nope/x'), false)
    assert.equal(await sb.files.exists('/'), true)
    await assert.rejects(sb.files.read('relative.txt'), InvalidRequest)
    await assert.rejects(sb.upload('.', 'relative'), InvalidRequest)

    f.on('GET', '/v1/sandboxes/sb_1', () => json(200, wireInfo('sb_1', { envd_url: null, access_token: null, cost_usd: 0.5 })))
    assert.equal(await sb.cost(), 0.5)
    assert.equal(sb.info.accessToken, 'tok-sb_1', 'a get keeps the data-plane token')
    f.on('POST', '/v1/sandboxes/sb_1/timeout', (c) => json(200, wireInfo('sb_1', { timeout: JSON.parse(c.body).timeout, envd_url: null, access_token: null })))
    assert.equal((await sb.setTimeout(60)).timeout, 60)
    await assert.rejects(sb.setTimeout(0), InvalidRequest)
    f.on('POST', '/v1/sandboxes/sb_1/pause', () => json(200, wireInfo('sb_1', { state: 'paused', envd_url: null, access_token: null })))
    f.on('POST', '/v1/sandboxes/sb_1/resume', () => json(200, wireInfo('sb_1', { envd_url: 'http://node2.test:2', access_token: 't2' })))
    assert.equal((await sb.pause()).state, 'paused')
    await sb.resume()
    assert.equal(sb.dataTarget().baseUrl, 'http://node2.test:2', 'a resume may move the sandbox')

    let kills = 0
    f.on('DELETE', '/v1/sandboxes/sb_1', () => {
      kills += 1
      return json(200, wireInfo('sb_1', { state: 'stopped', cost_usd: 0.75, envd_url: null, access_token: null }))
    })
    await assert.rejects((async () => {
      await using box = sb
      await box.files.read('/tmp/x')
      throw new Error('episode failed')
    })(), /episode failed/)
    assert.equal(kills, 1, 'await using kills even when the block throws')
    assert.equal(sb.costUsd, 0.75, 'the final record is kept')
    f.on('DELETE', '/v1/sandboxes/sb_2', () => json(404, { error: { code: 'sandbox_not_found', message: 'gone' } }))
    f.queue('POST', '/v1/sandboxes', () => json(201, wireInfo('sb_2')))
    {
      await using gone = await Sandbox.create(opts(f))
      assert.equal(gone.id, 'sb_2')
    } // a sandbox already gone is fine
  })

  test('list, history and usage follow pages and send the filters', async () => {
    const f = new FakeFetch()
    f.on('GET', '/v1/sandboxes', (c) => c.url.searchParams.get('cursor')
      ? json(200, { items: [wireInfo('sb_3')], next_cursor: null })
      : json(200, { items: [wireInfo('sb_1'), wireInfo('sb_2')], next_cursor: 'c1' }))
    const all: SandboxInfo[] = await Sandbox.list({ ...opts(f), state: ['running', 'paused'], metadata: { run: 'r.1' } })
    assert.deepEqual(all.map((s) => s.id), ['sb_1', 'sb_2', 'sb_3'])
    assert.deepEqual(f.calls[0]!.url.searchParams.getAll('state'), ['running', 'paused'])
    assert.equal(f.calls[0]!.url.searchParams.get('metadata.run'), 'r.1')
    await assert.rejects(Sandbox.list({ ...opts(f), state: 'asleep' }), InvalidRequest)
    const before = f.calls.length
    await Sandbox.list(opts(f))                                    // by default: the states that have not ended
    assert.deepEqual(f.calls[before]!.url.searchParams.getAll('state'), ['starting', 'running', 'pausing', 'paused', 'resuming'])
    await Sandbox.list({ ...opts(f), includeEnded: true })
    assert.deepEqual(f.calls.at(-1)!.url.searchParams.getAll('state'), [])
    const rec = { id: 'sb_1', template: 'base', vcpu: 1, memory_mb: 512, vcpu_s: 1, gb_s: 0.5, storage_gb_s: 0,
      cost_usd: 0.25, state: 'stopped', metadata: { my_key: 'v' }, pauses: [{ paused_at: 't', checkpoint_bytes: 1, storage_gb_s: 0 }] }
    f.on('GET', '/v1/history', (c) => json(200, { items: Array(Number(c.url.searchParams.get('limit'))).fill(rec), next_cursor: 'n' + f.calls.length }))
    const h = await Sandbox.history({ ...opts(f), since: '2026-01-02T03:04', until: new Date('2026-02-01T00:00:00Z'), limit: 5, pageSize: 2, template: 'base' })
    assert.equal(h.length, 5)
    assert.equal(h[0]!.costUsd, 0.25)
    assert.deepEqual(h[0]!.metadata, { my_key: 'v' }, 'metadata keys are kept as they are')
    assert.equal(h[0]!.pauses[0]!.checkpointBytes, 1)
    const hc = f.calls.filter((c) => c.url.pathname === '/v1/history')
    assert.deepEqual(hc.map((c) => c.url.searchParams.get('limit')), ['2', '2', '1'])
    assert.equal(hc[0]!.url.searchParams.get('since'), '2026-01-02T03:04:00.000Z', 'no zone means UTC')
    assert.equal(hc[0]!.url.searchParams.get('until'), '2026-02-01T00:00:00.000Z')
    await assert.rejects(Sandbox.history({ ...opts(f), since: 'yesterday' }), InvalidRequest)
    f.on('GET', '/v1/usage', () => json(200, { team_id: 't', sandboxes: 3, vcpu_s: 1, gb_s: 1, storage_gb_s: 0, cost_usd: 1, credits_usd: null, credits_unlimited: true }))
    const u = await Sandbox.usage({ ...opts(f), since: '2026-01-01' })
    assert.deepEqual([u.sandboxes, u.creditsUsd, u.creditsUnlimited], [3, null, true])
  })

  test('createMany: chunks of 100, per-item errors, and the made ones killed on failure', async () => {
    const f = new FakeFetch()
    const killed: string[] = []
    f.on('POST', '/v1/sandboxes/batch', (c) => {
      const n = JSON.parse(c.body).count
      return json(200, { created: n, failed: 0, items: Array.from({ length: n }, (_x, i) => i === 1
        ? { index: i, error: { code: 'capacity_unavailable', message: 'full' } }
        : { index: i, sandbox: wireInfo(`sb_${f.calls.length}_${i}`) }) })
    })
    f.on('DELETE', /^\/v1\/sandboxes\/sb_/, (c) => { killed.push(c.url.pathname); return json(200, wireInfo('x', { state: 'stopped' })) })
    const mixed = await Sandbox.createMany(150, { ...opts(f), returnErrors: true, capacityWait: 5 })
    assert.equal(mixed.length, 150)
    assert.ok(mixed[1] instanceof CapacityUnavailable && mixed[101] instanceof CapacityUnavailable)
    assert.ok(mixed[0] instanceof Sandbox)
    const bodies = f.calls.map((c) => JSON.parse(c.body))
    assert.deepEqual(bodies.map((b) => b.count), [100, 50])
    assert.equal(bodies[0].capacity_wait, 5)
    assert.notEqual(f.calls[0]!.headers.get('idempotency-key'), f.calls[1]!.headers.get('idempotency-key'))
    const err = await Sandbox.createMany(3, opts(f)).catch((e) => e)
    assert.ok(err instanceof CapacityUnavailable)
    assert.match(err.message, /^1 of 3 creates failed/)
    assert.deepEqual(Object.keys((err.details as { errors: object }).errors), ['1'])
    assert.equal(killed.length, 2, 'the two made ones were killed (one by one: this server has no batch kill)')
  })

  test('killMany: one request per 1,000 ids, per-id outcomes; createMany tears down with it', async () => {
    const f = new FakeFetch()
    const kills: { ids?: string[], labels?: Record<string, string> }[] = []
    f.on('POST', '/v1/sandboxes/kill', (c) => {
      const body = JSON.parse(c.body)
      kills.push(body)
      const ids: string[] = body.ids ?? ['sb_l1', 'sb_l2']
      const items = ids.map((id) => id === 'sb_nope'
        ? { id, sandbox: null, error: { code: 'sandbox_not_found', message: 'not found' } }
        : { id, sandbox: wireInfo(id, { state: 'stopped' }), error: null })
      const killed = items.filter((it) => it.sandbox).length
      return json(200, { items, killed, failed: items.length - killed })
    })
    const many = Array.from({ length: 1500 }, (_x, i) => `sb_${i}`)
    const res = await Sandbox.killMany([...many, 'sb_0', 'sb_nope'], opts(f))
    assert.deepEqual(kills.map((k) => k.ids!.length), [1000, 501], 'deduplicated, 1,000 a request')
    assert.deepEqual([res.killed, res.failed, res.items.length], [1500, 1, 1501])
    assert.equal(res.items[0]!.sandbox!.state, 'stopped')
    assert.equal(res.items[1500]!.error!.code, 'sandbox_not_found')
    const byLabel = await Sandbox.killMany(null, { ...opts(f), metadata: { run: 'a' } })
    assert.deepEqual(kills[2], { labels: { run: 'a' } })
    assert.deepEqual(byLabel.items.map((it) => it.id), ['sb_l1', 'sb_l2'])
    await assert.rejects(Sandbox.killMany(null, opts(f)), InvalidRequest)
    f.on('POST', '/v1/sandboxes/batch', () => json(200, { created: 2, failed: 1, items: [
      { index: 0, sandbox: wireInfo('sb_a') }, { index: 1, sandbox: wireInfo('sb_b') },
      { index: 2, error: { code: 'capacity_unavailable', message: 'full' } }] }))
    const err = await Sandbox.createMany(3, opts(f)).catch((e) => e)
    assert.ok(err instanceof CapacityUnavailable)
    assert.deepEqual(kills[3], { ids: ['sb_a', 'sb_b'] }, 'the made ones killed in one request')
    assert.equal(f.calls.filter((c) => c.method === 'DELETE').length, 0)
  })
})
