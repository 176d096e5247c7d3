import assert from 'node:assert/strict'
import { mkdtempSync, mkdirSync, readFileSync, writeFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, test } from 'node:test'

import {
  AuthenticationError, CapacityUnavailable, DiskQuotaExceeded, InvalidRequest, Conflict, InvalidState, PayloadTooLarge, NotFound, PillDropsError, RateLimited,
  SandboxNotFound, ServerError, TemplateNotFound, TransportError, RequestTimeout, VERSION, fromWire, resolveConfig,
} from '../../src/index.js'
import { backoffDelay, parseRetryAfter, RetryPolicy } from '../../src/retry.js'

describe('errors', () => {
  test('the code picks the class, then the status', () => {
    const e = fromWire(404, { error: { code: 'sandbox_not_found', message: 'gone', request_id: 'r1', details: { a: 1 } } })
    assert.ok(e instanceof SandboxNotFound && e instanceof NotFound && e instanceof PillDropsError && e instanceof Error)
    assert.equal(e.code, 'sandbox_not_found')
    assert.equal(e.status, 404)
    assert.equal(e.message, 'gone')
    assert.equal(e.requestId, 'r1')
    assert.deepEqual(e.details, { a: 1 })
    assert.equal(e.name, 'SandboxNotFound')
    assert.ok(fromWire(409, { error: { code: 'invalid_state', message: 'x' } }) instanceof InvalidState)
    assert.ok(fromWire(409, { error: { code: 'invalid_state' } }) instanceof Conflict)
    assert.ok(fromWire(404, { error: { code: 'template_not_found' } }) instanceof TemplateNotFound)
    const full = fromWire(413, { error: { code: 'disk_quota_exceeded', details: { free_bytes: 0 } } })
    assert.ok(full instanceof DiskQuotaExceeded && full instanceof PayloadTooLarge)
    assert.equal(full.code, 'disk_quota_exceeded')
    assert.ok(fromWire(503, null) instanceof CapacityUnavailable)
    assert.ok(fromWire(429, 'nope') instanceof RateLimited)
    assert.ok(fromWire(599, {}) instanceof ServerError)
    assert.equal(fromWire(418, {}).constructor, PillDropsError)
    assert.equal(fromWire(0, { error: { code: 'unheard_of', message: 'm' } }).code, 'error')
  })

  test('retryable, the transport branch and the wire form', () => {
    assert.equal(new CapacityUnavailable('x').retryable, true)
    assert.equal(new InvalidState('x').retryable, false)
    const t = new RequestTimeout('slow')
    assert.ok(t instanceof TransportError)
    assert.equal(t.code, 'request_timeout')
    assert.deepEqual(new ServerError('boom', { requestId: 'q' }).toJSON(),
      { error: { code: 'internal', message: 'boom', details: null, request_id: 'q' } })
  })
})

describe('config', () => {
  const dir = mkdtempSync(join(tmpdir(), 'pd-js-cfg-'))
  after(() => rmSync(dir, { recursive: true, force: true }))
  mkdirSync(join(dir, 'pilldrops'))
  writeFileSync(join(dir, 'pilldrops', 'config.json'), JSON.stringify({ api_url: 'http://file:1/', api_key: 'filekey' }))

  test('explicit > PILLDROPS_* > the CLI config file > E2B_API_KEY > default', () => {
    const env = { XDG_CONFIG_HOME: dir }
    assert.deepEqual([resolveConfig({}, env).apiUrl, resolveConfig({}, env).apiKey], ['http://file:1', 'filekey'])
    assert.match(resolveConfig({}, env).keySource, /^the config file .*config\.json$/)
    const e2b = { ...env, E2B_API_KEY: 'e2b' }
    assert.equal(resolveConfig({}, e2b).apiKey, 'filekey', 'the saved config file comes before E2B_API_KEY')
    const onlyE2b = { XDG_CONFIG_HOME: join(dir, 'none'), E2B_API_KEY: 'e2b' }
    assert.deepEqual([resolveConfig({}, onlyE2b).apiKey, resolveConfig({}, onlyE2b).keySource], ['e2b', '$E2B_API_KEY'])
    const pd = { ...e2b, PILLDROPS_API_KEY: 'pd', PILLDROPS_API_URL: 'http://env:2' }
    assert.equal(resolveConfig({}, pd).apiKey, 'pd')
    assert.equal(resolveConfig({}, pd).apiUrl, 'http://env:2')
    const c = resolveConfig({ apiKey: 'x', apiUrl: 'http://x:3///' }, pd)
    assert.deepEqual([c.apiKey, c.apiUrl, c.requestTimeout, c.maxRetries], ['x', 'http://x:3', 60, 3])
    assert.equal(resolveConfig({}, { XDG_CONFIG_HOME: join(dir, 'none'), PILLDROPS_API_KEY: 'k' }).apiUrl,
      'http://127.0.0.1:7070')
  })

  test('a malformed API URL is an InvalidRequest before any request', () => {
    for (const apiUrl of ['not a url', 'ftp://x', '127.0.0.1:7070']) {
      assert.throws(() => resolveConfig({ apiUrl, apiKey: 'k' }, {}), InvalidRequest, apiUrl)
    }
  })

  test('no key anywhere is an AuthenticationError before any request', () => {
    assert.throws(() => resolveConfig({}, { XDG_CONFIG_HOME: join(dir, 'none') }), AuthenticationError)
  })

  test('the version matches package.json', () => {
    const pkg = JSON.parse(readFileSync(new URL('../../../package.json', import.meta.url), 'utf8'))
    assert.equal(VERSION, pkg.version)
  })
})

describe('retry policy', () => {
  test('Retry-After as seconds or an HTTP date', () => {
    assert.equal(parseRetryAfter('3'), 3)
    assert.equal(parseRetryAfter('1.5'), 1.5)
    assert.equal(parseRetryAfter(null), null)
    assert.equal(parseRetryAfter('soon'), null)
    const now = Date.parse('2026-01-01T00:00:00Z')
    assert.equal(parseRetryAfter('Thu, 01 Jan 2026 00:00:07 GMT', now), 7)
    assert.equal(parseRetryAfter('Wed, 31 Dec 2025 00:00:00 GMT', now), 0)
  })

  test('exponential backoff with jitter, capped; Retry-After wins up to 60 s', () => {
    assert.equal(backoffDelay(0, null, 0.25, 4, () => 1), 0.25)
    assert.equal(backoffDelay(3, null, 0.25, 4, () => 1), 2)
    assert.equal(backoffDelay(10, null, 0.25, 4, () => 1), 4)
    assert.equal(backoffDelay(0, null, 0.25, 4, () => 0), 0.125)
    assert.equal(backoffDelay(0, 9), 9)
    assert.equal(backoffDelay(0, 999), 60)
  })

  test('ordinary failures: max retries, idempotent only; capacity: a total wait budget', () => {
    const p = new RetryPolicy(2, true, null, () => 1)
    assert.equal(p.nextDelay(new ServerError('x'), null), 0.25)
    assert.equal(p.nextDelay(new ServerError('x'), 1), 1)
    assert.equal(p.nextDelay(new ServerError('x'), null), null)
    assert.equal(new RetryPolicy(3, false).nextDelay(new ServerError('x'), null), null)
    assert.equal(new RetryPolicy(3, true).nextDelay(new InvalidState('x'), null), null)
    const notSent = new TransportError('refused')
    notSent.notSent = true
    assert.notEqual(new RetryPolicy(3, false).nextDelay(notSent, null), null)
    assert.equal(new RetryPolicy(3, false).nextDelay(new TransportError('reset'), null), null)
    const cap = new RetryPolicy(0, true, 5, () => 1)
    const waits = [cap.nextDelay(new CapacityUnavailable('full'), 2), cap.nextDelay(new RateLimited('slow'), 2),
      cap.nextDelay(new CapacityUnavailable('full'), 2), cap.nextDelay(new CapacityUnavailable('full'), 2)]
    assert.deepEqual(waits, [2, 2, 1, null])
    assert.equal(new RetryPolicy(0, true, 0).nextDelay(new CapacityUnavailable('full'), null), null)
  })
})
