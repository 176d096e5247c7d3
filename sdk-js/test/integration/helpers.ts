/**
 * Shared set-up of the integration tests: they run against the real `pilldrops up` that `scripts/test-js`
 * starts (through `sdk-js/tools/with_up.py`), which sets PILLDROPS_API_URL / PILLDROPS_API_KEY. After every
 * test no sandbox may be live and no container, mount, cgroup or process of the session may be left.
 */
import assert from 'node:assert/strict'
import { execFileSync } from 'node:child_process'
import { afterEach } from 'node:test'

import { Sandbox } from '../../src/index.js'

export const API_URL = process.env.PILLDROPS_API_URL ?? ''
export const API_KEY = process.env.PILLDROPS_API_KEY ?? ''
if (!API_URL || !API_KEY || !process.env.PD_LEAK_SNAPSHOT) {
  throw new Error('integration tests need a real `pilldrops up`: run them with scripts/test-js')
}

/** The repository root (examples/env lives there). */
export const REPO = new URL('../../../../', import.meta.url).pathname.replace(/\/$/, '')
export const RUN_ID = `tsjs-${process.pid}`
const LIVE = ['pending', 'starting', 'running', 'pausing', 'paused', 'resuming', 'stopping'] as const

/** Fail the test if a sandbox is left live or the host keeps anything of one (after a short settle). */
export function checkLeaksAfterEach(): void {
  afterEach(async () => {
    let live = await Sandbox.list({ state: [...LIVE] })
    for (let i = 0; i < 50 && live.length; i++) {
      await new Promise((r) => setTimeout(r, 100))
      live = await Sandbox.list({ state: [...LIVE] })
    }
    assert.deepEqual(live.map((s) => `${s.id}:${s.state}`), [], 'sandboxes left live by the test')
    execFileSync(process.env.PD_PYTHON!, [process.env.PD_LEAKS_PY!, 'check', process.env.PD_LEAK_SNAPSHOT!, '5'],
      { stdio: ['ignore', 'inherit', 'inherit'] })
  })
}
