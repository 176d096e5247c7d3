import assert from 'node:assert/strict'
import { mkdtempSync, mkdirSync, readFileSync, readlinkSync, symlinkSync, writeFileSync, existsSync, lstatSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, afterEach, beforeEach, describe, test } from 'node:test'

import * as tar from 'tar'

import { extractDownload, packUpload } from '../../src/archive.js'
import { InvalidRequest, map, ServerError, TemplateNotFound, CapacityUnavailable } from '../../src/index.js'
import { FakeFetch, OPTS, json, recordSleeps, wireInfo } from './fake.js'

async function members(file: string): Promise<string[]> {
  const names: string[] = []
  await tar.t({ file, onReadEntry: (e) => { names.push(`${e.type}:${e.path}${e.linkpath ? `->${e.linkpath}` : ''}`) } })
  return names.sort()
}

describe('upload packing', () => {
  const root = mkdtempSync(join(tmpdir(), 'pd-js-pack-'))
  after(() => rmSync(root, { recursive: true, force: true }))
  const env = join(root, 'env')
  mkdirSync(join(env, 'sub'), { recursive: true })
  writeFileSync(join(env, 'episode.py'), 'print(1)\n')
  writeFileSync(join(env, 'sub', 'data.txt'), 'x')
  symlinkSync('episode.py', join(env, 'link.py'))

  test('a directory: its contents, relative names, symlinks kept as symlinks', async () => {
    const plan = await packUpload(env, '/env/')
    try {
      assert.equal(plan.dest, '/env')
      assert.equal(plan.entries, 4)
      assert.deepEqual(await members(plan.tarPath),
        ['Directory:sub/', 'File:episode.py', 'File:sub/data.txt', 'SymbolicLink:link.py->episode.py'])
    } finally {
      await plan.cleanup()
    }
    assert.equal(existsSync(plan.tarPath), false)
  })

  test('a file: renamed to basename(remote), or kept with a trailing slash; missing is InvalidRequest', async () => {
    const a = await packUpload(join(env, 'episode.py'), '/x/run.py')
    assert.deepEqual([a.dest, a.entries, await members(a.tarPath)], ['/x', 1, ['File:run.py']])
    await a.cleanup()
    const b = await packUpload(join(env, 'episode.py'), '/x/')
    assert.deepEqual([b.dest, await members(b.tarPath)], ['/x', ['File:episode.py']])
    await b.cleanup()
    const c = await packUpload(join(env, 'link.py'), '/y/l.py')
    assert.deepEqual(await members(c.tarPath), ['SymbolicLink:l.py->episode.py'])
    await c.cleanup()
    await assert.rejects(packUpload(join(root, 'missing'), '/x'), InvalidRequest)
    const empty = join(root, 'empty')
    mkdirSync(empty)
    const d = await packUpload(empty, '/e')
    assert.deepEqual([d.entries, await members(d.tarPath)], [0, []])
    await d.cleanup()
  })
})

describe('download extraction', () => {
  const root = mkdtempSync(join(tmpdir(), 'pd-js-extract-'))
  after(() => rmSync(root, { recursive: true, force: true }))
  const src = join(root, 'src')
  mkdirSync(join(src, 'out', 'deep'), { recursive: true })
  writeFileSync(join(src, 'out', 'a.txt'), 'A')
  writeFileSync(join(src, 'out', 'deep', 'b.txt'), 'B')
  symlinkSync('a.txt', join(src, 'out', 'ln'))
  writeFileSync(join(src, 'single.txt'), 'S')

  test('a directory becomes local, or merges into an existing one; a file lands inside a directory', async () => {
    const t = join(root, 'dir.tar')
    await tar.c({ file: t, cwd: src, portable: true }, ['out'])
    const dst = await extractDownload(t, '/work/out', join(root, 'copy'))
    assert.equal(readFileSync(join(dst, 'deep', 'b.txt'), 'utf8'), 'B')
    assert.equal(readlinkSync(join(dst, 'ln')), 'a.txt')
    const existing = join(root, 'existing')
    mkdirSync(existing)
    writeFileSync(join(existing, 'keep'), 'K')
    await extractDownload(t, '/work/out', existing)
    assert.deepEqual([readFileSync(join(existing, 'keep'), 'utf8'), readFileSync(join(existing, 'a.txt'), 'utf8')], ['K', 'A'])
    const f = join(root, 'file.tar')
    await tar.c({ file: f, cwd: src, portable: true }, ['single.txt'])
    assert.equal(await extractDownload(f, '/single.txt', existing), join(existing, 'single.txt'))
    const renamed = await extractDownload(f, '/single.txt', join(root, 'renamed.txt'))
    assert.equal(readFileSync(renamed, 'utf8'), 'S')
  })

  test('unsafe archives from the sandbox are refused: ../, absolute names, links out, devices', async () => {
    const evil = join(root, 'evil')
    mkdirSync(join(evil, 'x'), { recursive: true })
    symlinkSync('/etc/passwd', join(evil, 'x', 'abs'))
    symlinkSync('../../../etc', join(evil, 'x', 'up'))
    for (const [name, member] of [['abs', 'x/abs'], ['up', 'x/up']] as const) {
      const t = join(root, `${name}.tar`)
      await tar.c({ file: t, cwd: evil, portable: true }, [member])
      await assert.rejects(extractDownload(t, '/x', join(root, `out-${name}`)), InvalidRequest)
      assert.equal(existsSync(join(root, `out-${name}`)), false)
    }
    // a member named ../escape (written with preservePaths)
    writeFileSync(join(root, 'escape'), 'E')
    const t = join(root, 'dotdot.tar')
    await tar.c({ file: t, cwd: join(root, 'evil'), preservePaths: true }, ['../escape'])
    await assert.rejects(extractDownload(t, '/escape', join(root, 'out-dd')), InvalidRequest)
    writeFileSync(join(root, 'garbage.tar'), 'this is not a tar archive at all'.repeat(40))
    await assert.rejects(extractDownload(join(root, 'garbage.tar'), '/x', join(root, 'out-g')), ServerError)
    assert.equal(lstatSync(root).isDirectory(), true)
  })
})

describe('map', () => {
  let sleeps: ReturnType<typeof recordSleeps>
  beforeEach(() => { sleeps = recordSleeps() })
  afterEach(() => sleeps.restore())

  function fleet(): { f: FakeFetch; live: Set<string>; peak: () => number } {
    const f = new FakeFetch()
    const live = new Set<string>()
    let n = 0
    let peak = 0
    f.on('POST', '/v1/sandboxes', async () => {
      const id = `sb_${n++}`
      live.add(id)
      peak = Math.max(peak, live.size)
      await new Promise((r) => setTimeout(r, 2))
      return json(201, wireInfo(id))
    })
    f.on('DELETE', /^\/v1\/sandboxes\//, (c) => {
      const id = c.url.pathname.split('/').pop()!
      live.delete(id)
      return json(200, wireInfo(id, { state: 'stopped' }))
    })
    return { f, live, peak: () => peak }
  }

  test('one sandbox per item, at most `concurrency` at once, in order, per-item errors, all killed', async () => {
    const { f, live, peak } = fleet()
    const seen: number[] = []
    const r = await map(async (sb, item: number, ctx) => {
      seen.push(ctx.index)
      await new Promise((res) => setTimeout(res, 3))
      if (item % 7 === 3) throw new Error(`bad ${item}`)
      return item * 2
    }, Array.from({ length: 30 }, (_x, i) => i), { ...OPTS, fetch: f.fetch, concurrency: 4 })
    assert.equal(r.length, 30)
    assert.equal(r.failed, 4)
    assert.equal(r.ok, 26)
    assert.deepEqual([...r.errors.keys()], [3, 10, 17, 24])
    assert.equal(r.results[2], 4)
    assert.ok(r.results[3] instanceof Error)
    assert.deepEqual(r.values().slice(0, 3), [0, 2, 4])
    assert.ok(peak() <= 4, `peak ${peak()}`)
    assert.equal(live.size, 0, 'every sandbox was killed')
    assert.throws(() => r.throwIfErrors(), /bad 3 .*4 of 30 items failed/)
  })

  test('a create error no item can get past stops the map; a capacity error is per item', async () => {
    const f = new FakeFetch().on('POST', '/v1/sandboxes', () => json(404, { error: { code: 'template_not_found', message: 'no such template' } }))
    let calls = 0
    await assert.rejects(map(async () => { calls++ }, [1, 2, 3, 4, 5, 6], { ...OPTS, fetch: f.fetch, concurrency: 2 }), TemplateNotFound)
    assert.equal(calls, 0)
    assert.ok(f.calls.length <= 2)
    const g = new FakeFetch().on('POST', '/v1/sandboxes', () => json(503, { error: { code: 'capacity_unavailable', message: 'full' } }))
    const r = await map(async () => 1, [1, 2], { ...OPTS, fetch: g.fetch, capacityWait: 0 })
    assert.equal(r.failed, 2)
    assert.ok(r.results[0] instanceof CapacityUnavailable)
  })
})
