/** `Sandbox`: one disposable sandbox, from create to kill. The TypeScript twin of the Python `AsyncSandbox`. */
import { mkdir, mkdtemp, rm } from 'node:fs/promises'
import { createWriteStream } from 'node:fs'
import { dirname, join, resolve } from 'node:path'
import { once } from 'node:events'

import { extractDownload, packUpload } from './archive.js'
import type { ConnectionOptions } from './config.js'
import {
  InvalidRequest, InvalidState, NodeUnavailable, PillDropsError, SandboxNotFound, TransportError, fromWire,
} from './errors.js'
import { Files } from './files.js'
import { APIClient, checkRemotePath, dataTarget, newIdempotencyKey, sandboxPath } from './http.js'
import type { Target } from './http.js'
import {
  checkLimit, checkTimeoutSeconds, createBody, itemMetadata, listParams, periodParams, portUrlBody, runTimeout,
  stringMap,
} from './params.js'
import type { Metadata, SpecArgs, StateFilter, TimeArg } from './params.js'
import { checkCapacityWait } from './retry.js'
import { DEFAULT_OUTPUT_CAP, RunDecoder, checkResult } from './run.js'
import type { RunResult } from './run.js'
import { toHistoryRecord, toSandboxInfo } from './wire.js'
import type {
  HistoryRecord, KillResult, PortURL, SandboxInfo, UsageSummary, WireBatchResponse, WireHistoryPage,
  WireKillResponse, WirePortURL, WireSandboxInfo, WireSandboxList, WireUsageSummary,
} from './wire.js'
import { SHAPES, camelize } from './wire.js'

// Node >= 18.18 has it; older runtimes get the well-known symbol TypeScript's `await using` looks up.
;(Symbol as { asyncDispose?: symbol }).asyncDispose ??= Symbol.for('nodejs.asyncDispose')

/** Items per `POST /v1/sandboxes/batch`. */
export const BATCH_CHUNK = 100
/** Ids per `POST /v1/sandboxes/kill` (the server's limit). */
const MAX_KILL = 1000
/** The longest NDJSON line a run stream may send (the node sends 256 KiB chunks, base64-encoded). */
const MAX_EVENT_LINE = 8 * 1024 * 1024

/** What `Sandbox.create` takes: the sandbox's spec ({@link SpecArgs}) and the connection settings. */
export interface CreateOptions extends ConnectionOptions, SpecArgs {
  /**
   * Seconds a create may spend waiting for room when the deployment is full (503 capacity_unavailable) or
   * rate limits (429), retrying with backoff and honouring `Retry-After` (default 120; 0: fail at once).
   */
  capacityWait?: number
  signal?: AbortSignal
}

export interface CreateManyOptions extends Omit<CreateOptions, 'metadata'> {
  /** Metadata for every sandbox, or a function of the item's index (`(i) => ({ episode: String(i) })`). */
  metadata?: Metadata<number>
  /** Seconds each item may wait for capacity on the server (default 60, at most 600). */
  capacityWait?: number
  /** Failed items are their error in the returned list (default false: throw the first, kill the rest). */
  returnErrors?: boolean
}

export interface RunOptions {
  /** Seconds; kills the command's process tree (then `timedOut` is set and `exitCode` is 124). */
  timeout?: number
  envs?: Record<string, string>
  cwd?: string
  /** Text fed to the command's stdin, then closed. */
  stdin?: string
  /** Decoded text chunks of stdout as they arrive. */
  onStdout?: (text: string) => unknown
  onStderr?: (text: string) => unknown
  /** Aborting ends the command (its process tree is killed) and the call throws `AbortError`. */
  signal?: AbortSignal
  /** Throw `CommandFailed` (with `.result`) when the exit code is not 0 (default false). */
  check?: boolean
  /** Bytes kept per stream (default 16 MiB); past it output is dropped and `truncated` is set. */
  maxOutputBytes?: number
}

export interface ListOptions extends ConnectionOptions {
  state?: StateFilter
  metadata?: Record<string, string>
  pageSize?: number
  /** The most records to return (default: all). */
  limit?: number
  signal?: AbortSignal
}

/** States of a sandbox that has not ended: what {@link Sandbox.list} returns by default. */
export const LIVE_STATES = ['starting', 'running', 'pausing', 'paused', 'resuming'] as const

export interface SandboxListOptions extends ListOptions {
  /** Ended sandboxes too (stopped, failed, lost); default: only live ones. Ignored when `state` is given. */
  includeEnded?: boolean
}

export interface HistoryOptions extends ListOptions {
  /** Sandboxes created at or after this time (a `Date`, or ISO 8601; no zone means UTC). */
  since?: TimeArg
  /** Sandboxes created before this time. */
  until?: TimeArg
  template?: string
}

export interface UsageOptions extends ConnectionOptions {
  since?: TimeArg
  until?: TimeArg
  signal?: AbortSignal
}

export interface UrlOptions {
  /** Seconds the URL's token stays valid (default 3600, at most 7 days). */
  expiresIn?: number
  /** Path (and query) inside the sandbox's server (default `/`). */
  path?: string
  signal?: AbortSignal
}

export interface CallOptions extends ConnectionOptions {
  signal?: AbortSignal
}

function client(opts: ConnectionOptions): APIClient {
  return APIClient.fromOptions(opts)
}

const ENDED_STATES: ReadonlySet<string> = new Set(['stopping', 'stopped', 'failed', 'lost'])

/** The error for using a sandbox that has ended ("sandbox sb_x is stopped (killed at ...)"), or null. */
export function stoppedError(info: SandboxInfo): InvalidState | null {
  if (!ENDED_STATES.has(info.state)) return null
  const why = info.endReason ?? info.state
  const at = info.endedAt ? new Date(info.endedAt) : null
  const when = at && !Number.isNaN(at.getTime()) ? ` at ${at.toISOString().replace('T', ' ').slice(0, 19)} UTC` : ''
  return new InvalidState(`sandbox ${info.id} is ${info.state} (${why}${when})`,
    { details: { from: info.state, end_reason: why, ended_at: info.endedAt ?? null } })
}

/**
 * A disposable sandbox. Create one per episode and kill it when done (`await using` does):
 *
 * ```ts
 * await using sb = await Sandbox.create({ template: 'code-interpreter', timeout: 600 })
 * await sb.upload('./env', '/env')
 * const r = await sb.run('python /env/episode.py')
 * const reward = parseFloat(r.stdout)
 * ```
 *
 * `sb.info` is the last known {@link SandboxInfo}, usage included; `kill()` (and so leaving the `await
 * using` block) stores the final record, so `sb.costUsd` is then the final cost without another call.
 * Every method throws only {@link PillDropsError} subclasses.
 */
export class Sandbox {
  /** The last known record (`kill()` stores the final one). */
  info: SandboxInfo
  /** Single-file access: `sb.files.read/write/list/exists`. */
  readonly files: Files
  readonly client: APIClient

  constructor(info: SandboxInfo, apiClient: APIClient) {
    this.info = info
    this.client = apiClient
    this.files = new Files(this)
  }

  /** The sandbox id (`sb_...`). */
  get id(): string {
    return this.info.id
  }

  /** The last known cost in USD (no request): final once `kill()` ran or the `await using` block ended. */
  get costUsd(): number {
    return this.info.costUsd
  }

  toString(): string {
    return `<Sandbox ${this.id} template=${this.info.template} state=${this.info.state}>`
  }

  /** What `console.log(sb)` shows (never the access token or the API key). */
  [Symbol.for('nodejs.util.inspect.custom')](): string {
    return this.toString()
  }

  /** Where data-plane calls go: the node directly (with the sandbox's access token) when known. */
  dataTarget(): Target {
    return dataTarget(this.info, this.client)
  }

  private update(w: WireSandboxInfo): SandboxInfo {
    const info = toSandboxInfo(w)
    // Listings and get never carry the data-plane address or token: keep the ones we have.
    if (info.envdUrl == null && info.accessToken == null) {
      info.envdUrl = this.info.envdUrl
      info.accessToken = this.info.accessToken
    }
    this.info = info
    return info
  }

  /**
   * One data-plane call: using a sandbox this object saw end fails at once, saying so; a failure of a
   * sandbox that has ended meanwhile becomes "sandbox X is stopped (timeout at ...)".
   */
  async dataCall<T>(call: () => Promise<T>): Promise<T> {
    const ended = stoppedError(this.info)
    if (ended) throw ended
    try {
      return await call()
    } catch (err) {
      if (!(err instanceof SandboxNotFound || err instanceof InvalidState || err instanceof NodeUnavailable ||
            err instanceof TransportError)) throw err
      let info: SandboxInfo
      try {
        info = await this.getInfo()
      } catch {
        throw err
      }
      const better = stoppedError(info)
      if (!better) throw err
      ;(better as { cause?: unknown }).cause = err
      throw better
    }
  }

  // ------------------------------------------------------------------------------------ lifecycle

  /**
   * Create a sandbox and return it running. The create is retried safely: one `Idempotency-Key` is reused
   * by every attempt, so a retry never makes a second sandbox. When the deployment is full it waits up to
   * `capacityWait` seconds (default 120) for room. Throws `InsufficientCredits` when credits are used up.
   */
  static async create(opts?: CreateOptions): Promise<Sandbox>
  static async create(template: string, opts?: CreateOptions): Promise<Sandbox>
  static async create(a: string | CreateOptions = {}, b: CreateOptions = {}): Promise<Sandbox> {
    const opts: CreateOptions = typeof a === 'string' ? { ...b, template: a } : a
    const capacityWait = checkCapacityWait(opts.capacityWait ?? 120)
    const body = createBody(opts)
    const c = client(opts)
    const info = await c.json<WireSandboxInfo>('POST', '/v1/sandboxes', { expect: SHAPES.sandbox,
      json: body, headers: { 'Idempotency-Key': newIdempotencyKey() }, idempotent: true, capacityWait,
      signal: opts.signal,
    })
    return new Sandbox(toSandboxInfo(info), c)
  }

  /**
   * Create `count` sandboxes of one spec with `POST /v1/sandboxes/batch` (chunks of 100), in order. They
   * queue on the server under admission control, each waiting up to `capacityWait` seconds (default 60),
   * and each succeeds or fails on its own. Without `returnErrors`, if any item failed the ones made are
   * killed and the first item's error is thrown (`details.errors` maps every failed index to its error).
   */
  static async createMany(count: number, opts: CreateManyOptions & { returnErrors: true }):
    Promise<(Sandbox | PillDropsError)[]>
  static async createMany(count: number, opts?: CreateManyOptions): Promise<Sandbox[]>
  static async createMany(count: number, opts: CreateManyOptions = {}): Promise<(Sandbox | PillDropsError)[]> {
    checkLimit(count, 'count')
    const capacityWait = checkCapacityWait(opts.capacityWait ?? 60)
    const perItem = typeof opts.metadata === 'function'
    const body = {
      ...createBody({ ...opts, metadata: perItem ? {} : itemMetadata(opts.metadata, 0) }),
      capacity_wait: Math.min(capacityWait, 600),
    }
    const c = client(opts)
    const out: (Sandbox | PillDropsError)[] = []
    try {
      for (let start = 0; start < count; start += BATCH_CHUNK) {
        const n = Math.min(BATCH_CHUNK, count - start)
        const page = await c.json<WireBatchResponse>('POST', '/v1/sandboxes/batch', { expect: SHAPES.batch,
          json: {
            ...body, count: n,
            ...(perItem ? { item_metadata: Array.from({ length: n }, (_x, i) => itemMetadata(opts.metadata, start + i)) } : {}),
          },
          headers: { 'Idempotency-Key': newIdempotencyKey() }, idempotent: true,
          timeout: c.config.requestTimeout + capacityWait + 0.5 * n, signal: opts.signal,
        })
        for (const item of page.items) {
          out.push(item.sandbox ? new Sandbox(toSandboxInfo(item.sandbox), c)
            : fromWire(0, { error: item.error ?? {} }))
        }
      }
    } catch (err) {
      await killAll(out) // a later chunk failed as a whole: never leave the earlier ones running
      throw err
    }
    const failed = out.map((x, i) => [i, x] as const).filter(([, x]) => x instanceof PillDropsError) as
      [number, PillDropsError][]
    if (failed.length && !opts.returnErrors) {
      await killAll(out)
      const first = failed[0]![1]
      first.details = {
        errors: Object.fromEntries(failed.map(([i, e]) => [i, `${e.code}: ${e.message}`])),
        ...(first.details ? { first: first.details } : {}),
      }
      first.message = `${failed.length} of ${count} creates failed; first: ${first.message}`
      throw first
    }
    return out
  }

  /** Attach to a running sandbox by id. Throws `SandboxNotFound`, or `InvalidState` when it is not running. */
  static async connect(sandboxId: string, opts: CallOptions = {}): Promise<Sandbox> {
    const c = client(opts)
    const info = await c.json<WireSandboxInfo>('POST', sandboxPath(sandboxId, '/connect'),
      { expect: SHAPES.sandbox, idempotent: true, signal: opts.signal })
    return new Sandbox(toSandboxInfo(info), c)
  }

  /** One sandbox's record (any state) without connecting. Throws `SandboxNotFound`. */
  static async getInfo(sandboxId: string, opts: CallOptions = {}): Promise<SandboxInfo> {
    const info = await client(opts).json<WireSandboxInfo>('GET', sandboxPath(sandboxId),
      { expect: SHAPES.sandbox, idempotent: true, signal: opts.signal })
    return toSandboxInfo(info)
  }

  /** Kill a sandbox by id. Idempotent: killing an ended sandbox returns its final record. */
  static async kill(sandboxId: string, opts: CallOptions = {}): Promise<SandboxInfo> {
    const info = await client(opts).json<WireSandboxInfo>('DELETE', sandboxPath(sandboxId),
      { expect: SHAPES.sandbox, idempotent: true, signal: opts.signal })
    return toSandboxInfo(info)
  }

  /**
   * Kill many sandboxes in one request per 1,000: by id, or (`{ metadata }`) every live one whose metadata
   * has all the pairs. Idempotent; the server calls each node once and records all the ends in one
   * transaction. Every id's outcome is in `items` (`sandbox`: its final record; `error`: why not, e.g.
   * `sandbox_not_found` for an id that is not your team's); a failed item does not throw.
   */
  static async killMany(sandboxIds: string[] | null, opts: CallOptions & { metadata?: Record<string, string> } = {}):
    Promise<KillResult> {
    if ((sandboxIds == null) === (opts.metadata == null)) {
      throw new InvalidRequest('give sandbox ids or metadata, not both and not neither')
    }
    return killMany(client(opts), sandboxIds, opts.metadata, opts.signal)
  }

  /** Pause a running sandbox by id; returns its record (state `paused`). */
  static async pause(sandboxId: string, opts: CallOptions = {}): Promise<SandboxInfo> {
    const info = await client(opts).json<WireSandboxInfo>('POST', sandboxPath(sandboxId, '/pause'),
      { expect: SHAPES.sandbox, idempotent: false, signal: opts.signal })
    return toSandboxInfo(info)
  }

  /** Resume a paused sandbox by id and return it connected. */
  static async resume(sandboxId: string, opts: CallOptions = {}): Promise<Sandbox> {
    const c = client(opts)
    const info = await c.json<WireSandboxInfo>('POST', sandboxPath(sandboxId, '/resume'),
      { expect: SHAPES.sandbox, idempotent: false, signal: opts.signal })
    return new Sandbox(toSandboxInfo(info), c)
  }

  /** Set a sandbox's timeout by id: it is killed `seconds` from now. */
  static async setTimeout(sandboxId: string, seconds: number, opts: CallOptions = {}): Promise<SandboxInfo> {
    checkTimeoutSeconds(seconds)
    const info = await client(opts).json<WireSandboxInfo>('POST', sandboxPath(sandboxId, '/timeout'),
      { expect: SHAPES.sandbox, json: { timeout: seconds }, idempotent: true, signal: opts.signal })
    return toSandboxInfo(info)
  }

  /**
   * The caller's live sandboxes (not yet ended: starting, running, paused, …), newest first, following every
   * page; `includeEnded` lists ended ones too; `state` (one state or several) picks the states instead.
   */
  static async list(opts: SandboxListOptions = {}): Promise<SandboxInfo[]> {
    const pageSize = opts.pageSize ?? 100
    checkLimit(opts.limit)
    checkLimit(pageSize, 'pageSize')
    const c = client(opts)
    const items: SandboxInfo[] = []
    let cursor: string | null = null
    for (;;) {
      const size = opts.limit === undefined ? pageSize : Math.min(pageSize, opts.limit - items.length)
      const page: WireSandboxList = await c.json<WireSandboxList>('GET', '/v1/sandboxes', { expect: SHAPES.sandboxList,
        idempotent: true, params: listParams(opts.state ?? (opts.includeEnded ? undefined : [...LIVE_STATES]),
          opts.metadata, size, cursor), signal: opts.signal,
      })
      items.push(...page.items.map(toSandboxInfo))
      if (opts.limit !== undefined && items.length >= opts.limit) return items.slice(0, opts.limit)
      if (!page.next_cursor || page.next_cursor === cursor) return items
      cursor = page.next_cursor
    }
  }

  /**
   * The team's sandboxes with their usage and cost, newest first, following every page. `since`/`until`
   * select sandboxes created in `[since, until)`; `limit` caps the records returned.
   *
   * ```ts
   * const records = await Sandbox.history({ since: '2025-01-01', metadata: { run: 'ppo-7' } })
   * const total = records.reduce((s, r) => s + r.costUsd, 0)
   * ```
   */
  static async history(opts: HistoryOptions = {}): Promise<HistoryRecord[]> {
    const pageSize = opts.pageSize ?? 100
    checkLimit(opts.limit)
    checkLimit(pageSize, 'pageSize')
    const period = periodParams(opts.since, opts.until)
    const c = client(opts)
    const items: HistoryRecord[] = []
    let cursor: string | null = null
    for (;;) {
      const size = opts.limit === undefined ? pageSize : Math.min(pageSize, opts.limit - items.length)
      const params = [...period, ...(opts.template ? [['template', opts.template] as [string, string]] : []),
        ...listParams(opts.state, opts.metadata, size, cursor)]
      const page: WireHistoryPage = await c.json<WireHistoryPage>('GET', '/v1/history',
        { expect: SHAPES.history, idempotent: true, params, signal: opts.signal })
      items.push(...page.items.map(toHistoryRecord))
      if (opts.limit !== undefined && items.length >= opts.limit) return items.slice(0, opts.limit)
      if (!page.items.length || !page.next_cursor || page.next_cursor === cursor) return items
      cursor = page.next_cursor
    }
  }

  /** The team's usage totals over `[since, until)` (default: all time) and its credit balance. */
  static async usage(opts: UsageOptions = {}): Promise<UsageSummary> {
    const params = periodParams(opts.since, opts.until)
    const u = await client(opts).json<WireUsageSummary>('GET', '/v1/usage',
      { expect: SHAPES.usage, idempotent: true, params, signal: opts.signal })
    return camelize(u)
  }

  /** Fetch the current record (state, `endAt`, usage so far, ...) and update `info`. */
  async getInfo(opts: { signal?: AbortSignal } = {}): Promise<SandboxInfo> {
    return this.update(await this.client.json<WireSandboxInfo>('GET', sandboxPath(this.id),
      { expect: SHAPES.sandbox, idempotent: true, signal: opts.signal }))
  }

  /** The cost in USD so far (final once ended), fetched now; also refreshes `info`. */
  async cost(opts: { signal?: AbortSignal } = {}): Promise<number> {
    return (await this.getInfo(opts)).costUsd
  }

  /** Whether the sandbox is running right now (false once it is gone). */
  async isRunning(): Promise<boolean> {
    try {
      return (await this.getInfo()).state === 'running'
    } catch (err) {
      if (err instanceof SandboxNotFound) return false
      throw err
    }
  }

  /** Kill the sandbox `seconds` from now instead of at its current `endAt` (max 86400). */
  async setTimeout(seconds: number, opts: { signal?: AbortSignal } = {}): Promise<SandboxInfo> {
    checkTimeoutSeconds(seconds)
    return this.update(await this.client.json<WireSandboxInfo>('POST', sandboxPath(this.id, '/timeout'),
      { expect: SHAPES.sandbox, json: { timeout: seconds }, idempotent: true, signal: opts.signal }))
  }

  /**
   * A URL that reaches `port` inside the sandbox (a server on its own loopback), HTTP and WebSocket (the same
   * address with `ws://`), through the control plane. It carries a signed token valid for `expiresIn` seconds
   * for this sandbox and port only, so it can be pasted into a browser (the first request leaves a cookie for
   * that sandbox and port, so the page's own links work). A port made public at create (`publicPorts` /
   * `public`) gets a URL without a token.
   */
  async getUrl(port: number, opts: UrlOptions = {}): Promise<string> {
    return (await this.getUrlInfo(port, opts)).url
  }

  /** `getUrl` with its expiry (`expiresAt`, null for a public port) and `public` flag. */
  async getUrlInfo(port: number, opts: UrlOptions = {}): Promise<PortURL> {
    const body = portUrlBody(port, opts)
    return camelize(await this.client.json<WirePortURL>('POST', sandboxPath(this.id, '/urls'),
      { expect: SHAPES.portUrl, json: body, idempotent: true, signal: opts.signal }))
  }

  /** Kill the sandbox now. Idempotent; returns (and stores in `info`) the final record with its final cost. */
  async kill(opts: { signal?: AbortSignal } = {}): Promise<SandboxInfo> {
    return this.update(await this.client.json<WireSandboxInfo>('DELETE', sandboxPath(this.id),
      { expect: SHAPES.sandbox, idempotent: true, signal: opts.signal }))
  }

  /**
   * Pause: processes and memory go to disk; it holds no RAM or CPU and bills storage only until
   * `resume()`. Paused time does not count against its timeout. Throws `InvalidState` unless running,
   * `NotSupported` when its node cannot checkpoint.
   */
  async pause(opts: { signal?: AbortSignal } = {}): Promise<SandboxInfo> {
    return this.update(await this.client.json<WireSandboxInfo>('POST', sandboxPath(this.id, '/pause'),
      { expect: SHAPES.sandbox, idempotent: false, signal: opts.signal }))
  }

  /** Resume exactly where it left off (it may come back on another node: the data-plane address is refreshed). */
  async resume(opts: { signal?: AbortSignal } = {}): Promise<SandboxInfo> {
    return this.update(await this.client.json<WireSandboxInfo>('POST', sandboxPath(this.id, '/resume'),
      { expect: SHAPES.sandbox, idempotent: false, signal: opts.signal }))
  }

  /** `await using sb = await Sandbox.create(...)`: the sandbox is killed when the block ends, whatever happens. */
  async [Symbol.asyncDispose](): Promise<void> {
    try {
      await this.kill()
    } catch (err) {
      if (!(err instanceof SandboxNotFound)) throw err
    }
  }

  // ------------------------------------------------------------------------------------ commands

  /**
   * Run a command to completion. `cmd` is a shell command line, or an argv array run without a shell.
   * A non-zero exit is returned, not thrown, unless `check: true`. The HTTP stream has no read deadline,
   * so long commands are never cut by the client; `signal` ends the command.
   *
   * ```ts
   * const r = await sb.run('echo hi') // r.stdout === 'hi\n', r.exitCode === 0
   * ```
   */
  async run(cmd: string | string[], opts: RunOptions = {}): Promise<RunResult> {
    if (typeof cmd === 'string' ? !cmd.trim() : !Array.isArray(cmd) || !cmd.length ||
        cmd.some((p) => typeof p !== 'string')) {
      throw new InvalidRequest('invalid cmd: a non-empty command line or argv array of strings is required')
    }
    runTimeout(opts.timeout)
    const maxOutputBytes = opts.maxOutputBytes ?? DEFAULT_OUTPUT_CAP
    if (!Number.isInteger(maxOutputBytes) || maxOutputBytes < 1 || maxOutputBytes > 256 * 1024 * 1024) {
      throw new InvalidRequest(`invalid maxOutputBytes: must be an integer in [1, 268435456], got ${maxOutputBytes}`)
    }
    const body: Record<string, unknown> = {
      cmd, envs: stringMap(opts.envs, 'envs', true), max_output_bytes: maxOutputBytes,
    }
    if (opts.cwd !== undefined) body.cwd = opts.cwd
    if (opts.timeout !== undefined) body.timeout = opts.timeout
    if (opts.stdin !== undefined) body.stdin = opts.stdin
    const decoder = new RunDecoder(cmd, { onStdout: opts.onStdout, onStderr: opts.onStderr, maxOutputBytes })
    const result = await this.dataCall(async () => {
      const stream = await this.client.stream('POST', sandboxPath(this.id, '/run'), {
        target: this.dataTarget(), json: body, idempotent: false, signal: opts.signal,
      })
      try {
        for await (const line of stream.lines(MAX_EVENT_LINE)) {
          decoder.feed(line)
          if (decoder.done) break
        }
      } finally {
        stream.close()
      }
      return decoder.result()   // a stream cut before the exit event: explained if the sandbox ended
    })
    return opts.check ? checkResult(result) : result
  }

  // ------------------------------------------------------------------------------------ files

  /**
   * Copy a local file or directory into the sandbox as one tar stream; returns the entry count.
   * `upload('./env', '/env')` makes `/env` hold the directory's contents; `upload('./a.txt', '/x/b.txt')`
   * writes the file at `/x/b.txt` (`'/x/'` keeps the name `a.txt`). Symlinks stay symlinks; parents are
   * created. Not retried once sent.
   */
  async upload(local: string, remote: string, opts: { signal?: AbortSignal } = {}): Promise<number> {
    checkRemotePath(remote, 'remote path')
    const plan = await packUpload(local, remote)
    try {
      await this.dataCall(() => this.client.request('PUT', sandboxPath(this.id, '/archive'), {
        target: this.dataTarget(), params: [['path', plan.dest]], body: () => plan.body(),
        headers: { 'Content-Type': 'application/x-tar' }, idempotent: false, signal: opts.signal,
        timeout: this.client.config.requestTimeout + plan.size / (1024 * 1024), // + 1 s per MiB sent
      }))
    } finally {
      await plan.cleanup()
    }
    return plan.entries
  }

  /**
   * Copy a file or directory out of the sandbox so that `local` becomes it; returns its path. Extraction is
   * safe (no absolute names, `../` or links out). If `local` is an existing directory, a directory is merged
   * into it and a file lands inside it. Throws `FileNotFound`.
   */
  async download(remote: string, local: string, opts: { signal?: AbortSignal } = {}): Promise<string> {
    checkRemotePath(remote, 'remote path')
    let tmp: string | null = null
    try {
      const parent = dirname(resolve(local))
      await mkdir(parent, { recursive: true })
      tmp = await mkdtemp(join(parent, '.pilldrops-download-'))
      const tarPath = join(tmp, 'download.tar')
      await this.dataCall(async () => {
        const stream = await this.client.stream('GET', sandboxPath(this.id, '/archive'), {
          target: this.dataTarget(), params: [['path', remote]], idempotent: true, signal: opts.signal,
        })
        const out = createWriteStream(tarPath)
        try {
          for await (const chunk of stream.chunks()) {
            if (!out.write(chunk)) await once(out, 'drain')
          }
        } finally {
          stream.close()
          out.end()
          await once(out, 'close')
        }
      })
      return await extractDownload(tarPath, remote, local)
    } catch (err) {
      if (err instanceof PillDropsError) throw err
      // a local filesystem failure (permissions, disk full): named with the local path
      throw new InvalidRequest(`could not write the download of ${remote} to ${local}: ${(err as Error).message}`,
        { cause: err })
    } finally {
      if (tmp) await rm(tmp, { recursive: true, force: true })
    }
  }

}

async function killMany(c: APIClient, sandboxIds: string[] | null, metadata: Record<string, string> | undefined,
  signal?: AbortSignal): Promise<KillResult> {
  const bodies: Record<string, unknown>[] = []
  if (sandboxIds != null) {
    const ids = [...new Set(sandboxIds)]
    for (let i = 0; i < ids.length; i += MAX_KILL) bodies.push({ ids: ids.slice(i, i + MAX_KILL) })
  } else {
    bodies.push({ labels: stringMap(metadata, 'metadata', false) })
  }
  const out: KillResult = { items: [], killed: 0, failed: 0 }
  while (bodies.length) {
    const body = bodies.shift()!
    const got = await c.json<WireKillResponse>('POST', '/v1/sandboxes/kill',
      { expect: SHAPES.kill, json: body, idempotent: true, signal })
    for (const it of got.items) {
      out.items.push({ id: it.id, sandbox: it.sandbox ? toSandboxInfo(it.sandbox) : null, error: it.error ?? null })
    }
    out.killed += got.killed
    out.failed += got.failed
    if ('labels' in body && got.killed >= MAX_KILL) bodies.push(body) // at most 1,000 a call: more may match
  }
  return out
}

async function killAll(items: (Sandbox | PillDropsError)[]): Promise<void> {
  const made = items.filter((x): x is Sandbox => x instanceof Sandbox)
  if (!made.length) return
  let final = new Map<string, SandboxInfo>()
  try { // one batch-kill request for all of them (the server calls each node once)
    const res = await killMany(made[0]!.client, made.map((sb) => sb.id), undefined)
    final = new Map(res.items.filter((it) => it.sandbox).map((it) => [it.id, it.sandbox!]))
  } catch {
    // a server without batch kills: one by one below
  }
  await Promise.all(made.map(async (sb) => {
    const info = final.get(sb.id)
    if (info) {
      sb.info = info
      return
    }
    try {
      await sb.kill()
    } catch {
      // best effort: the server's timeout ends it anyway
    }
  }))
}
