import assert from 'node:assert/strict'
import { mkdtempSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterEach, beforeEach, describe, test } from 'node:test'

import * as tar from 'tar'

import { FileNotFound, Sandbox, TransportError } from '../../src/index.js'
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
    const before = f.calls.length
    await assert.rejects(sb.upload(join(root, 'env'), '/env'), TransportError)
    assert.equal(f.calls.length, before + 1, 'an upload that may have been received is not resent')
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
