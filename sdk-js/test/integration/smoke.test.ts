/**
 * The "done when": the seed's TypeScript example, pasted into an empty project that installed the
 * packed tarball (`npm pack`), runs 64 concurrent rollouts of examples/env against the real `pilldrops up`
 * and returns the same rewards as the Python example (README) run with the Python SDK against the same
 * server, and as the episodes run on the host.
 */
import assert from 'node:assert/strict'
import { execFileSync } from 'node:child_process'
import { cpSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, test } from 'node:test'

import { REPO, checkLeaksAfterEach } from './helpers.js'

checkLeaksAfterEach()
const N = 64
const SDK = join(REPO, 'sdk-js')
const work = mkdtempSync(join(tmpdir(), 'pd-js-smoke-'))
after(() => rmSync(work, { recursive: true, force: true }))

// The seed example from the issue, verbatim between the two comment lines; `policies` and the print around it.
const SEED = `
// npm i @pilldrops/sdk
import { Sandbox } from '@pilldrops/sdk'
async function rollout(policy: string) {
  const sb = await Sandbox.create({ template: 'code-interpreter' })
  await sb.upload('./env', '/env')
  const r = await sb.run(\`python /env/episode.py --policy \${policy}\`)
  await sb.kill()
  return parseFloat(r.stdout)
}
const rewards = await Promise.all(policies.map(rollout))
`

const PYTHON_EXAMPLE = `
import json, sys
from pilldrops import Sandbox
from concurrent.futures import ThreadPoolExecutor

def rollout(policy):
    with Sandbox.create(template="code-interpreter", vcpu=1, memory_mb=512, timeout=600) as sb:
        sb.upload(sys.argv[1], "/env")
        r = sb.run(f"python /env/episode.py --policy {policy}")
        return float(r.stdout)

with ThreadPoolExecutor(max_workers=64) as pool:
    rewards = list(pool.map(rollout, range(${N})))
print(json.dumps(rewards))
`

function sh(cmd: string, args: string[], cwd: string, env: NodeJS.ProcessEnv = process.env): string {
  return execFileSync(cmd, args, { cwd, env, stdio: ['ignore', 'pipe', 'inherit'] }).toString()
}

test(`the seed example from a packed tarball: ${N} concurrent rollouts, the same rewards as the Python example`, async () => {
  // npm pack of the built package (scripts/test-js ran `npm run build`)
  const packed = sh('npm', ['pack', '--silent', '--pack-destination', work], SDK).trim().split('\n').pop()!
  const tgz = join(work, packed)
  const project = join(work, 'project')
  cpSync(join(REPO, 'examples', 'env'), join(project, 'env'), { recursive: true })
  writeFileSync(join(project, 'package.json'), JSON.stringify({ name: 'seed', private: true, type: 'module' }))
  sh('npm', ['install', '--prefer-offline', '--no-audit', '--no-fund', '--loglevel=error', tgz], project)
  assert.ok(readdirSync(join(project, 'node_modules', '@pilldrops', 'sdk', 'dist', 'esm')).includes('index.d.ts'))
  writeFileSync(join(project, 'seed.ts'),
    `const policies = Array.from({ length: ${N} }, (_, i) => String(i))\n${SEED}\nconsole.log(JSON.stringify(rewards))\n`)
  // type-check and compile the pasted TypeScript against the installed package's declarations
  sh(process.execPath, [join(SDK, 'node_modules', 'typescript', 'bin', 'tsc'), '--strict', '--target', 'es2022',
    '--module', 'nodenext', '--moduleResolution', 'nodenext', '--skipLibCheck', 'seed.ts'], project)
  const t0 = performance.now()
  const ts: number[] = JSON.parse(sh(process.execPath, ['seed.js'], project))
  const tsSeconds = (performance.now() - t0) / 1000
  // CommonJS consumers get the same package
  assert.equal(sh(process.execPath, ['-e', "console.log(typeof require('@pilldrops/sdk').Sandbox.create)"], project).trim(),
    'function')

  const t1 = performance.now()
  const py: number[] = JSON.parse(sh(process.env.PD_PYTHON!, ['-c', PYTHON_EXAMPLE, join(REPO, 'examples', 'env')], REPO))
  const pySeconds = (performance.now() - t1) / 1000
  const host: number[] = JSON.parse(sh(process.env.PD_PYTHON!, ['-c',
    `import json, sys; sys.path.insert(0, 'examples/env'); from episode import episode; print(json.dumps([episode(i) for i in range(${N})]))`],
  REPO))
  console.log(`# ${N} rollouts: TypeScript ${tsSeconds.toFixed(1)} s, Python ${pySeconds.toFixed(1)} s`)
  assert.equal(ts.length, N)
  assert.ok(ts.every((r) => Number.isFinite(r)))
  assert.deepEqual(ts, py, 'the TypeScript rewards are the Python example\'s')
  assert.deepEqual(ts, host, 'and those of the same episodes run on the host')
})
