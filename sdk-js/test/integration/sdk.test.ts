/** The SDK against a real `pilldrops up` (real crun sandboxes of the `tiny` busybox template). */
import assert from 'node:assert/strict'
import { execFileSync } from 'node:child_process'
import { mkdirSync, mkdtempSync, readFileSync, readlinkSync, symlinkSync, writeFileSync, readdirSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { describe, test } from 'node:test'
import { randomBytes } from 'node:crypto'

import {
  AbortError, AuthenticationError, CommandFailed, FileNotFound, InvalidRequest, InvalidState, NotSupported,
  Sandbox, SandboxNotFound, TemplateNotFound, TransportError, map,
} from '../../src/index.js'
import { API_URL, RUN_ID, checkLeaksAfterEach } from './helpers.js'

checkLeaksAfterEach()
const TINY = { template: 'tiny', memoryMb: 128, timeout: 120 }

describe('lifecycle', () => {
  test('create, info, list, connect, setTimeout, cost, kill, history and usage', async () => {
    const tag = `${RUN_ID}-life`
    const sb = await Sandbox.create({ ...TINY, metadata: { run: tag } })
    try {
      assert.match(sb.id, /^sb_/)
      assert.equal(sb.info.state, 'running')
      assert.ok(sb.info.envdUrl && sb.info.accessToken, 'create returns the data-plane address and token')
      assert.notEqual(new URL(sb.info.envdUrl!).port, new URL(API_URL).port, 'the data plane is the node, directly')
      assert.equal((await Sandbox.getInfo(sb.id)).state, 'running')
      assert.deepEqual((await Sandbox.list({ metadata: { run: tag } })).map((s) => s.id), [sb.id])
      assert.deepEqual((await Sandbox.list({ metadata: { run: tag }, state: 'stopped' })).map((s) => s.id), [])
      const other = await Sandbox.connect(sb.id)
      assert.equal((await other.run('echo connected')).stdout, 'connected\n')
      const before = Date.parse(sb.info.endAt!)
      const info = await sb.setTimeout(3600)
      assert.ok(Date.parse(info.endAt!) > before + 3000 * 1000)
      assert.ok((await sb.cost()) >= 0)
      assert.equal(await sb.isRunning(), true)
    } finally {
      const final = await sb.kill()
      assert.equal(final.state, 'stopped')
      assert.equal(final.endReason, 'killed')
    }
    assert.ok(sb.costUsd >= 0 && sb.info.vcpuS >= 0)
    assert.equal((await Sandbox.kill(sb.id)).state, 'stopped', 'killing again returns the final record')
    assert.equal(await sb.isRunning(), false)
    await assert.rejects(Sandbox.connect(sb.id), InvalidState)
    await assert.rejects(sb.run('true'), (e: unknown) => e instanceof InvalidState &&
      new RegExp(`^sandbox ${sb.id} is stopped \\(killed at .* UTC\\)$`).test(e.message))
    const hist = await Sandbox.history({ metadata: { run: tag } })
    assert.deepEqual(hist.map((h) => [h.id, h.state]), [[sb.id, 'stopped']])
    assert.equal(hist[0]!.costUsd, sb.costUsd)
    assert.equal((await Sandbox.history({ metadata: { run: tag }, until: '2000-01-01' })).length, 0)
    const usage = await Sandbox.usage()
    assert.ok(usage.sandboxes >= 1 && usage.costUsd >= 0)
  })

  test('errors carry the server codes; no raw fetch error', async () => {
    await assert.rejects(Sandbox.create({ template: 'no-such-template' }), TemplateNotFound)
    await assert.rejects(Sandbox.getInfo('sb_doesnotexist'), SandboxNotFound)
    await assert.rejects(Sandbox.list({ apiKey: 'pd_wrong' }), AuthenticationError)
    await assert.rejects(Sandbox.create({ ...TINY, memoryMb: 8 }), InvalidRequest)
    const closed = await Sandbox.getInfo('sb_x', { apiUrl: 'http://127.0.0.1:9', maxRetries: 0 }).catch((e) => e)
    assert.ok(closed instanceof TransportError, String(closed))
  })

  test('await using kills the sandbox when the block ends, also when it throws', async () => {
    let id = ''
    {
      await using sb = await Sandbox.create(TINY)
      id = sb.id
      assert.equal((await sb.run('true')).exitCode, 0)
    }
    assert.equal((await Sandbox.getInfo(id)).state, 'stopped')
    let id2 = ''
    await assert.rejects((async () => {
      await using sb = await Sandbox.create(TINY)
      id2 = sb.id
      throw new Error('episode blew up')
    })(), /episode blew up/)
    const info = await Sandbox.getInfo(id2)
    assert.deepEqual([info.state, info.endReason], ['stopped', 'killed'])
  })

  test('createMany and map: per-item results and errors, every sandbox killed', async () => {
    const many = await Sandbox.createMany(3, { ...TINY, metadata: (i) => ({ run: `${RUN_ID}-batch`, episode: String(i) }) })
    try {
      assert.equal(new Set(many.map((s) => s.id)).size, 3)
      assert.deepEqual(many.map((s) => s.info.metadata.episode), ['0', '1', '2'])
      const outs = await Promise.all(many.map((s) => s.run('echo $((6*7))')))
      assert.deepEqual(outs.map((r) => r.stdout), ['42\n', '42\n', '42\n'])
    } finally {
      await Promise.all(many.map((s) => s.kill()))
    }
    const res = await map(async (sb, n: number) => {
      const r = await sb.run(`echo $((${n} * ${n}))`, { check: true })
      if (n === 2) await sb.run('exit 3', { check: true })
      return Number(r.stdout)
    }, [1, 2, 3, 4, 5], { ...TINY, concurrency: 3, metadata: (n) => ({ run: `${RUN_ID}-map`, n: String(n) }) })
    assert.deepEqual(res.values(), [1, 9, 16, 25])
    assert.deepEqual([...res.errors.keys()], [1])
    assert.ok(res.results[1] instanceof CommandFailed)
    assert.deepEqual(res.items.map((it) => [it.ok, it.endReason, it.metadata.n]),
      [[true, 'killed', '1'], [false, 'killed', '2'], [true, 'killed', '3'], [true, 'killed', '4'], [true, 'killed', '5']])
    const hist = await Sandbox.history({ metadata: { run: `${RUN_ID}-map` } })
    assert.deepEqual(new Set(hist.map((h) => h.id)), new Set(res.items.map((it) => it.sandboxId)))
    const billed = hist.reduce((sum, h) => sum + h.costUsd, 0)
    assert.ok(Math.abs(res.totalCostUsd - billed) < 1e-9, `${res.totalCostUsd} vs ${billed}`)
  })

  test('pause and resume keep the sandbox (or NotSupported where the node has no CRIU)', async (t) => {
    await using sb = await Sandbox.create(TINY)
    await sb.files.write('/root/state', 'kept')
    try {
      await sb.pause()
    } catch (err) {
      if (err instanceof NotSupported) {
        t.skip(`this node cannot checkpoint: ${err.message}`)
        return
      }
      throw err
    }
    assert.equal(sb.info.state, 'paused')
    await assert.rejects(sb.run('true'), InvalidState)
    await sb.resume()
    assert.equal(await sb.files.read('/root/state'), 'kept')
    // the same by id, as another process would
    assert.equal((await Sandbox.pause(sb.id)).state, 'paused')
    await assert.rejects(Sandbox.pause(sb.id), InvalidState)
    const again = await Sandbox.resume(sb.id)
    assert.equal((await again.run('cat /root/state')).stdout, 'kept')
    assert.ok(Date.parse((await Sandbox.setTimeout(sb.id, 600)).endAt!) > Date.now() + 500_000)
  })
})

describe('commands', () => {
  test('stdout, stderr, exit code, envs, cwd, stdin, argv, streaming callbacks, check', async () => {
    await using sb = await Sandbox.create({ ...TINY, envs: { GLOBAL: 'g' } })
    const r = await sb.run('echo "$GLOBAL $LOCAL $(pwd)"; echo err >&2; exit 3', { envs: { LOCAL: 'l' }, cwd: '/tmp' })
    assert.deepEqual([r.stdout, r.stderr, r.exitCode, r.ok, r.timedOut], ['g l /tmp\n', 'err\n', 3, false, false])
    assert.ok(r.duration > 0)
    assert.equal((await sb.run(['echo', 'a b', '$HOME'])).stdout, 'a b $HOME\n', 'argv runs without a shell')
    assert.equal((await sb.run('cat', { stdin: 'fed\u00e9' })).stdout, 'fed\u00e9')
    const chunks: string[] = []
    const streamed = await sb.run('for i in 1 2 3; do echo line$i; sleep 0.2; done', { onStdout: (t) => chunks.push(t) })
    assert.equal(chunks.join(''), streamed.stdout)
    assert.ok(chunks.length >= 2, `output arrives as it is produced (${chunks.length} chunks)`)
    await assert.rejects(sb.run('echo oops >&2; exit 5', { check: true }),
      (e: unknown) => e instanceof CommandFailed && /exited with code 5: oops/.test(e.message))
    const capped = await sb.run('head -c 200000 /dev/zero | tr "\\0" x', { maxOutputBytes: 1000 })
    assert.deepEqual([capped.stdout.length, capped.truncated], [1000, true])
  })

  test('a run that times out is killed with its process tree: timedOut, exit code 124', async () => {
    await using sb = await Sandbox.create(TINY)
    const t0 = performance.now()
    const r = await sb.run('sleep 60 & sleep 60; echo never', { timeout: 1 })
    assert.deepEqual([r.timedOut, r.exitCode, r.stdout], [true, 124, ''])
    assert.ok(performance.now() - t0 < 15_000)
    assert.equal((await sb.run('ps -o comm | grep -c "^sleep" || true')).stdout.trim(), '0', 'no sleep survives')
  })

  test('an AbortSignal ends a run and its command', async () => {
    await using sb = await Sandbox.create(TINY)
    const ac = new AbortController()
    const t0 = performance.now()
    setTimeout(() => ac.abort(new Error('enough')), 700)
    const err = await sb.run('echo started; sleep 60', { signal: ac.signal }).catch((e) => e)
    assert.ok(err instanceof AbortError, String(err))
    assert.ok(performance.now() - t0 < 10_000)
    let left = '1'
    for (let i = 0; i < 50 && left !== '0'; i++) {
      left = (await sb.run('ps -o comm | grep -c "^sleep" || true')).stdout.trim()
      if (left !== '0') await new Promise((r) => setTimeout(r, 100))
    }
    assert.equal(left, '0', 'the aborted command was killed in the sandbox')
  })
})

describe('ports by URL', () => {
  test('getUrl reaches a server in the sandbox; refused without its token; a public port needs none', async () => {
    const sb = await Sandbox.create({ ...TINY, publicPorts: [8081] })
    try {
      assert.deepEqual(sb.info.publicPorts, [8081])
      await sb.files.write('/srv/index.html', 'hi from busybox')
      assert.equal((await sb.run('busybox httpd -p 127.0.0.1:8080 -h /srv && busybox httpd -p 127.0.0.1:8081 -h /srv')).exitCode, 0)
      const url = await sb.getUrl(8080, { expiresIn: 60 })
      assert.match(url, new RegExp(`/ports/${sb.id}/8080/\\?pd_token=`))
      let r = await fetch(url)
      for (let i = 0; r.status === 502 && i < 50; i++) {     // httpd forks into the background: wait for it
        await new Promise((res) => setTimeout(res, 100))
        r = await fetch(url)
      }
      assert.equal(r.status, 200)
      assert.equal(await r.text(), 'hi from busybox')
      r = await fetch(url.split('?')[0]!)
      assert.equal(r.status, 401)
      assert.equal(((await r.json()) as { error: { code: string } }).error.code, 'url_token_required')
      const info = await sb.getUrlInfo(8081)
      assert.equal(info.public, true)
      assert.equal(info.expiresAt, null)
      assert.equal(await (await fetch(info.url)).text(), 'hi from busybox')
    } finally {
      await sb.kill()
    }
  })
})

describe('files', () => {
  test('upload a directory as one tar stream, download it back byte for byte', async (t) => {
    const root = mkdtempSync(join(tmpdir(), 'pd-js-it-'))
    t.after(() => rmSync(root, { recursive: true, force: true }))
    const env = join(root, 'env')
    mkdirSync(join(env, 'a', 'b'), { recursive: true })
    writeFileSync(join(env, 'episode.py'), 'print(1.5)\n')
    writeFileSync(join(env, 'a', 'b', 'deep.txt'), 'deep')
    const blob = randomBytes(3 * 1024 * 1024)
    writeFileSync(join(env, 'a', 'blob.bin'), blob)
    symlinkSync('episode.py', join(env, 'link.py'))
    await using sb = await Sandbox.create(TINY)
    assert.equal(await sb.upload(env, '/env'), 6)
    const listing = await sb.run('cd /env && find . | sort && readlink link.py && md5sum a/blob.bin')
    const md5 = execFileSync('md5sum', [join(env, 'a', 'blob.bin')]).toString().split(' ')[0]
    assert.equal(listing.stdout, ['.', './a', './a/b', './a/b/deep.txt', './a/blob.bin', './episode.py', './link.py',
      'episode.py', `${md5}  a/blob.bin`].join('\n') + '\n')
    assert.equal(await sb.upload(join(env, 'episode.py'), '/opt/renamed.py'), 1)
    assert.equal(await sb.files.read('/opt/renamed.py'), 'print(1.5)\n')
    const back = await sb.download('/env', join(root, 'back'))
    assert.deepEqual(readdirSync(back).sort(), ['a', 'episode.py', 'link.py'])
    assert.ok(readFileSync(join(back, 'a', 'blob.bin')).equals(blob))
    assert.equal(readlinkSync(join(back, 'link.py')), 'episode.py')
    const one = await sb.download('/env/a/b/deep.txt', join(root, 'deep-copy.txt'))
    assert.equal(readFileSync(one, 'utf8'), 'deep')
    await assert.rejects(sb.download('/nope', join(root, 'x')), FileNotFound)
    await assert.rejects(sb.upload(join(root, 'missing'), '/x'), InvalidRequest)
  })

  test('files.read / write / list / exists', async () => {
    await using sb = await Sandbox.create(TINY)
    const info = await sb.files.write('/root/dir/x.txt', 'h\u00e9llo')
    assert.deepEqual([info.path, info.type, info.size], ['/root/dir/x.txt', 'file', 6])
    assert.equal(await sb.files.read('/root/dir/x.txt'), 'h\u00e9llo')
    await sb.files.write('/root/dir/bin', new Uint8Array([0, 255, 1]))
    assert.deepEqual([...await sb.files.readBytes('/root/dir/bin')], [0, 255, 1])
    assert.deepEqual((await sb.files.list('/root/dir')).map((f) => f.name).sort(), ['bin', 'x.txt'])
    assert.equal(await sb.files.exists('/root/dir/x.txt'), true)
    assert.equal(await sb.files.exists('/root/dir/none'), false)
    await assert.rejects(sb.files.read('/root/none'), FileNotFound)
    await assert.rejects(sb.files.read('root/x'), InvalidRequest)
  })
})

describe('configuration', () => {
  test('the config file that `pilldrops up` wrote is found without any environment variable', async () => {
    const env: Record<string, string> = { PATH: process.env.PATH!, XDG_CONFIG_HOME: process.env.PD_CONFIG_HOME! }
    const code = `import('${new URL('../../src/index.js', import.meta.url).href}').then(async ({ Sandbox }) => {
      const sbs = await Sandbox.list({ includeEnded: true }); console.log(JSON.stringify(sbs.map((s) => s.id)))
    })`
    const out = execFileSync(process.execPath, ['-e', code], { env }).toString()
    const mine = (await Sandbox.list({ includeEnded: true })).map((s) => s.id)
    assert.ok(mine.length > 0)
    assert.deepEqual(JSON.parse(out), mine)
    const bad = { ...env, PILLDROPS_API_KEY: 'pd_bad' }
    assert.throws(() => execFileSync(process.execPath, ['-e', code.replace('console.log', 'void')],
      { env: bad, stdio: 'pipe' }), /AuthenticationError/)
  })
})
