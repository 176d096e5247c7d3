import assert from 'node:assert/strict'
import { mkdtempSync, mkdirSync, readFileSync, writeFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, afterEach, beforeEach, describe, test } from 'node:test'

import * as tar from 'tar'

import { FileNotFound, InvalidState, Sandbox, TransportError, map } from '../../src/index.js'
import { FakeFetch, OPTS, json, recordSleeps, refused, wireInfo } from './fake.js'

let sleeps: ReturnType<typeof recordSleeps>
beforeEach(() => { sleeps = recordSleeps() })
afterEach(() => sleeps.restore())

async function made(f: FakeFetch, extra: Record<string, unknown> = {}): Promise<Sandbox> {
  f.queue('POST', '/v1/sandboxes', () => json(201, wireInfo('sb_1')))
  return Sandbox.create({ ...OPTS, fetch: f.fetch, ...extra })
}

describe('transfers', () => {
  const root = mkdtempSync(join(tmpdir(), 'pd-js-xfer-'))
  after(() => rmSync(root, { recursive: true, force: true }))
  mkdirSync(join(root, 'env', 'sub'), { recursive: true })
  writeFileSync(join(root, 'env', 'episode.py'), 'print(2)\n')
  writeFileSync(join(root, 'env', 'sub', 'w.txt'), 'w')

  test('upload sends one tar stream to the node, resent only when it never left', async () => {
    const f = new FakeFetch()
    const sb = await made(f)
    const got: { path: string | null; type: string | null; bytes: number }[] = []
    f.queue('PUT', '/v1/sandboxes/sb_1/archive', () => refused(), (c) => {
      got.push({ path: c.url.searchParams.get('path'), type: c.headers.get('content-type'), bytes: c.body.length })
      return json(200, { entries: 3 })
    })
    assert.equal(await sb.upload(join(root, 'env'), '/env'), 3)
    assert.deepEqual(got.map((g) => [g.path, g.type]), [['/env', 'application/x-tar']])
    assert.ok(got[0]!.bytes >= 2048 && got[0]!.bytes % 512 === 0, 'a whole tar archive was sent')
    assert.equal(f.calls.at(-1)!.url.origin, 'http://node.test:1')
    f.queue('PUT', '/v1/sandboxes/sb_1/archive', () => { throw new TypeError('fetch failed', { cause: Object.assign(new Error('reset'), { code: 'ECONNRESET' }) }) })
    const puts = () => f.calls.filter((c) => c.method === 'PUT').length
    const before = puts()
    await assert.rejects(sb.upload(join(root, 'env'), '/env'), TransportError)
    assert.equal(puts(), before + 1, 'an upload that may have been received is not resent')
  })

  test('download streams the archive to disk and unpacks it safely', async () => {
    const f = new FakeFetch()
    const sb = await made(f)
    const t = join(root, 'served.tar')
    await tar.c({ file: t, cwd: root, portable: true }, ['env'])
    f.on('GET', '/v1/sandboxes/sb_1/archive', (c) => c.url.searchParams.get('path') === '/env'
      ? new Response(readFileSync(t)) : json(404, { error: { code: 'file_not_found', message: 'nope' } }))
    const out = await sb.download('/env', join(root, 'got'))
    assert.equal(readFileSync(join(out, 'sub', 'w.txt'), 'utf8'), 'w')
    await assert.rejects(sb.download('/missing', join(root, 'x')), FileNotFound)
  })

  test('the request deadline bounds opening a run stream, not reading it', async () => {
    const f = new FakeFetch()
    const sb = await made(f, { requestTimeout: 0.05 })
    f.on('POST', '/v1/sandboxes/sb_1/run', () => new Response(new ReadableStream({
      async start(c) {
        const enc = new TextEncoder()
        c.enqueue(enc.encode('{"type":"start","pid":1}\n'))
        await new Promise((r) => setTimeout(r, 200))
        c.enqueue(enc.encode('{"type":"exit","exit_code":0,"duration":0.2}\n'))
        c.close()
      },
    })))
    const r = await sb.run('sleep 0.2')
    assert.deepEqual([r.exitCode, r.duration], [0, 0.2])
  })
})

describe('parity with the Python SDK (issue 17)', () => {
  test('using a sandbox seen to end fails at once, saying so; a data failure of an ended one is explained', async () => {
    const f = new FakeFetch()
    const sb = await made(f)
    f.on('DELETE', '/v1/sandboxes/sb_1', () => json(200, wireInfo('sb_1', {
      state: 'stopped', end_reason: 'killed', ended_at: '2026-12-01T08:00:00Z', envd_url: null, access_token: null })))
    await sb.kill()
    const before = f.calls.length
    const err = await sb.run('true').catch((e) => e)
    assert.ok(err instanceof InvalidState)
    assert.equal(err.message, 'sandbox sb_1 is stopped (killed at 2026-12-01 08:00:00 UTC)')
    await assert.rejects(sb.files.read('/x'), InvalidState)
    assert.equal(f.calls.length, before, 'no request')

    const g = new FakeFetch()
    const sb2 = await made(g)
    g.on('POST', '/v1/sandboxes/sb_1/run', () => { throw new TypeError('fetch failed', { cause: Object.assign(new Error('reset'), { code: 'ECONNRESET' }) }) })
    g.on('GET', '/v1/sandboxes/sb_1', () => json(200, wireInfo('sb_1', { state: 'stopped', end_reason: 'timeout', envd_url: null, access_token: null })))
    const e2 = await sb2.run('sleep 1000').catch((e) => e)
    assert.ok(e2 instanceof InvalidState && e2.cause instanceof TransportError)
    assert.equal(e2.message, 'sandbox sb_1 is stopped (timeout)')
  })

  test('createMany metadata per index (item_metadata), list limit', async () => {
    const f = new FakeFetch()
    f.on('POST', '/v1/sandboxes/batch', (c) => {
      const b = JSON.parse(c.body)
      return json(200, { created: b.count, failed: 0, items: Array.from({ length: b.count }, (_x, i) => ({ index: i, sandbox: wireInfo(`sb_${i}`, { metadata: b.item_metadata[i] }) })) })
    })
    const sbs = await Sandbox.createMany(3, { ...OPTS, fetch: f.fetch, metadata: (i) => ({ episode: String(i) }) })
    assert.deepEqual(sbs.map((s) => s.info.metadata.episode), ['0', '1', '2'])
    const body = JSON.parse(f.calls[0]!.body)
    assert.deepEqual([body.metadata, body.item_metadata], [{}, [{ episode: '0' }, { episode: '1' }, { episode: '2' }]])
    f.on('GET', '/v1/sandboxes', (c) => json(200, { items: Array.from({ length: Number(c.url.searchParams.get('limit')) }, (_x, i) => wireInfo(`sb_${i}`)), next_cursor: 'more' }))
    assert.equal((await Sandbox.list({ ...OPTS, fetch: f.fetch, limit: 3, pageSize: 2 })).length, 3)
  })

  test('map: per-item sandbox id, final cost, end reason, metadata from the item; total cost', async () => {
    const f = new FakeFetch()
    let n = 0
    f.on('POST', '/v1/sandboxes', (c) => json(201, wireInfo(`sb_${n++}`, { metadata: JSON.parse(c.body).metadata })))
    f.on('DELETE', /^\/v1\/sandboxes\//, (c) => {
      const id = c.url.pathname.split('/').pop()!
      return json(200, wireInfo(id, { state: 'stopped', end_reason: 'killed', cost_usd: 0.25, metadata: { seed: 'x' }, envd_url: null, access_token: null }))
    })
    const res = await map(async (_sb, seed: number) => {
      if (seed === 2) throw new Error('no')
      return seed * 10
    }, [1, 2, 3], { ...OPTS, fetch: f.fetch, metadata: (seed) => ({ seed: String(seed) }), concurrency: 1 })
    assert.deepEqual(res.items.map((it) => [it.index, it.value, it.ok, it.costUsd, it.endReason]),
      [[0, 10, true, 0.25, 'killed'], [1, null, false, 0.25, 'killed'], [2, 30, true, 0.25, 'killed']])
    assert.equal(res.items[1]!.error!.message, 'no')
    assert.deepEqual(f.calls.filter((c) => c.method === 'POST').map((c) => JSON.parse(c.body).metadata), [{ seed: '1' }, { seed: '2' }, { seed: '3' }])
    assert.equal(res.totalCostUsd, 0.75)
    assert.ok(res.items.every((it) => it.sandboxId && it.duration >= 0))
  })
})
