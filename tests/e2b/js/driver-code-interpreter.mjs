// The stock npm @e2b/code-interpreter client as a test driver (tests/e2b/test_stock_js.py), configured only by
// E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY; prints one JSON object with what it saw.
import { Sandbox } from '@e2b/code-interpreter'

const out = {}
const sbx = await Sandbox.create()
try {
  out.template = (await sbx.getInfo()).templateId
  const stdout = []
  const first = await sbx.runCode('x = 20\nprint("from js")\nx * 2 + 2', { onStdout: (m) => stdout.push(m.line) })
  out.first = { text: first.text, stdout: first.logs.stdout, streamed: stdout, error: first.error ?? null }
  out.state = (await sbx.runCode('x + 1')).text
  const err = (await sbx.runCode('raise ValueError("bad value")')).error
  out.error = { name: err.name, value: err.value, hasTraceback: err.traceback.includes('ValueError') }
  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  out.context = { language: ctx.language, cwd: ctx.cwd, isolated: (await sbx.runCode('x', { context: ctx })).error?.name }
} finally {
  out.killed = await sbx.kill()
}
console.log(JSON.stringify(out))
