// The stock npm `e2b` client as a test driver (tests/e2b/test_stock_js.py). Configured only by
// E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY; prints one JSON object with what it saw.
// Usage: node driver.mjs lifecycle|envd
import { Sandbox, CommandExitError, NotFoundError, SandboxNotFoundError } from 'e2b'

const mode = process.argv[2] || 'lifecycle'
const out = {}

async function errorName(fn) {
  try { await fn(); return null } catch (e) { return e?.constructor?.name || String(e) }
}

const sbx = await Sandbox.create({ metadata: { driver: 'js' }, timeoutMs: 120_000 })
try {
  out.id = sbx.sandboxId
  const info = await sbx.getInfo()
  out.info = { templateId: info.templateId, state: info.state, metadata: info.metadata, cpuCount: info.cpuCount }
  const paginator = Sandbox.list({ query: { metadata: { driver: 'js' } } })
  out.listed = (await paginator.nextItems()).map((s) => s.sandboxId)
  await sbx.setTimeout(60_000)
  const end = (await sbx.getInfo()).endAt
  out.timeoutLeftS = Math.round((new Date(end) - Date.now()) / 1000)
  const again = await Sandbox.connect(sbx.sandboxId)
  out.connected = again.sandboxId
  if (mode === 'envd') {
    const r = await sbx.commands.run('echo hi; echo err >&2')
    out.run = { stdout: r.stdout, stderr: r.stderr, exitCode: r.exitCode }
    try {
      await sbx.commands.run('exit 3')
      out.exit = null
    } catch (e) {
      out.exit = { name: e.constructor.name, exitCode: e.exitCode, isCommandExit: e instanceof CommandExitError }
    }
    await sbx.files.write('/tmp/js/a.txt', 'from js')
    await sbx.files.write([{ path: '/tmp/js/b.txt', data: 'two' }, { path: '/tmp/js/c.txt', data: 'three' }])
    out.read = await sbx.files.read('/tmp/js/a.txt')
    out.listDir = (await sbx.files.list('/tmp/js')).map((e) => e.name).sort()
    out.exists = [await sbx.files.exists('/tmp/js/b.txt'), await sbx.files.exists('/tmp/js/nope')]
    out.readMissing = await errorName(() => sbx.files.read('/tmp/js/nope'))
    const bg = await sbx.commands.run('sleep 0.3; echo bg', { background: true })
    out.background = (await bg.wait()).stdout
    out.running = await sbx.isRunning()
  }
} finally {
  out.killed = await sbx.kill()
}
out.killedAgain = await Sandbox.kill(out.id)
out.getInfoAfterKill = await errorName(() => Sandbox.getInfo(out.id))
if (mode === 'envd') out.runAfterKill = await errorName(() => sbx.commands.run('echo x'))
out.notFoundClass = [NotFoundError.name, SandboxNotFoundError?.name]
console.log(JSON.stringify(out))
