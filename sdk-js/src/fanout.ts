/**
 * `map`: one fresh sandbox per item, `concurrency` at a time, with per-item errors (the twin of the Python
 * SDK's `pilldrops.amap`).
 *
 * ```ts
 * const rewards = await map(async (sb, policy) => {
 *   await sb.upload('./env', '/env')
 *   return parseFloat((await sb.run(`python /env/episode.py --policy ${policy}`, { check: true })).stdout)
 * }, policies, { template: 'code-interpreter', concurrency: 64 })
 * console.log(rewards.ok, 'ok,', rewards.failed, 'failed')
 * ```
 *
 * Each item gets its own sandbox, created for it and killed after it whatever happens. Creates wait for
 * capacity (`capacityWait`) instead of failing. A failing item never stops the others; a create error no
 * item can get past (unknown template, bad key or shape, no credits) stops the whole map and is thrown.
 */
import {
  AbortError, AuthenticationError, InsufficientCredits, InvalidRequest, PermissionDenied, TemplateNotFound,
} from './errors.js'
import { itemMetadata } from './params.js'
import type { Metadata } from './params.js'
import { Sandbox } from './sandbox.js'
import type { CreateOptions } from './sandbox.js'

export interface MapContext {
  /** The item's index in the input. */
  index: number
  /** Fires when the whole map is stopped (a fatal create error, or the caller's `signal`). */
  signal: AbortSignal
}

export interface MapProgress {
  done: number
  failed: number
  total: number
}

export interface MapOptions<T = unknown> extends Omit<CreateOptions, 'signal' | 'metadata'> {
  /** Metadata for every sandbox, or a function of the item (`(seed) => ({ seed: String(seed) })`). */
  metadata?: Metadata<T>
  /** Items in flight at once (default 64). */
  concurrency?: number
  /** Seconds a create may wait for room in the fleet (default 600). */
  capacityWait?: number
  /** Called after every finished item. */
  onProgress?: (p: MapProgress) => void
  /** Stops starting new items and is passed on to `fn` (as `ctx.signal`); the map then throws `AbortError`. */
  signal?: AbortSignal
}

/** Errors of the create that no item can get past: the whole map stops with the first. */
const FATAL_CREATE_ERRORS = [TemplateNotFound, AuthenticationError, PermissionDenied, InvalidRequest, InsufficientCredits]

/** One item of a {@link map}: its value or error, and its episode's sandbox, final cost and end. */
export interface MapItem<R> {
  index: number
  value: R | null
  error: Error | null
  ok: boolean
  /** null when the item's create failed. */
  sandboxId: string | null
  /** The sandbox's final cost (null when its create failed). */
  costUsd: number | null
  /** Seconds from the create's start to the sandbox's teardown, as this client saw them. */
  duration: number
  endReason: string | null
  metadata: Record<string, string>
}

/** Results in item order; a failed item's slot holds its error (also in {@link errors}). */
export class MapResult<R> implements Iterable<R | Error> {
  constructor(readonly results: (R | Error)[], readonly errors: ReadonlyMap<number, Error>,
              /** Seconds the map took. */ readonly elapsed: number,
              /** Per item: value or error, sandbox id, final cost, duration, end reason, metadata. */
              readonly items: MapItem<R>[] = []) {}

  /** The cost of every item's sandbox, in USD. */
  get totalCostUsd(): number {
    return this.items.reduce((sum, it) => sum + (it.costUsd ?? 0), 0)
  }

  get length(): number {
    return this.results.length
  }

  get ok(): number {
    return this.results.length - this.errors.size
  }

  get failed(): number {
    return this.errors.size
  }

  /** The results of the items that succeeded, in order. */
  values(): R[] {
    return this.results.filter((_r, i) => !this.errors.has(i)) as R[]
  }

  /** Throw the first item's error (with every failed index in its message) if any item failed; else this. */
  throwIfErrors(): this {
    const idx = [...this.errors.keys()].sort((a, b) => a - b)
    if (idx.length) {
      const first = this.errors.get(idx[0]!)!
      first.message += ` (map: ${idx.length} of ${this.length} items failed, indices ${idx.slice(0, 20).join(', ')}` +
        `${idx.length > 20 ? ', ...' : ''}; this is item ${idx[0]})`
      throw first
    }
    return this
  }

  [Symbol.iterator](): Iterator<R | Error> {
    return this.results[Symbol.iterator]()
  }
}

/**
 * Call `fn(sandbox, item, ctx)` for every item, each in a fresh sandbox killed right after it,
 * `concurrency` at a time. Resolves to a {@link MapResult} in item order.
 */
export async function map<T, R>(fn: (sb: Sandbox, item: T, ctx: MapContext) => Promise<R> | R,
                                items: Iterable<T>, opts: MapOptions<T> = {}): Promise<MapResult<R>> {
  const work = [...items]
  const { concurrency = 64, onProgress, signal, metadata, ...create } = opts
  if (!Number.isInteger(concurrency) || concurrency < 1) {
    throw new InvalidRequest(`concurrency must be a positive integer, got ${String(concurrency)}`)
  }
  const meta = work.map((item) => itemMetadata(metadata, item))
  const results: (R | Error)[] = new Array(work.length)
  const errors = new Map<number, Error>()
  const perItem: MapItem<R>[] = meta.map((m, index) => ({
    index, value: null, error: null, ok: false, sandboxId: null, costUsd: null, duration: 0, endReason: null, metadata: m,
  }))
  const stop = new AbortController()
  const onAbort = () => stop.abort(signal?.reason)
  if (signal?.aborted) stop.abort(signal.reason)
  else signal?.addEventListener('abort', onAbort, { once: true })
  let fatal: Error | null = null
  let next = 0
  let finished = 0
  const t0 = performance.now()
  const fail = (i: number, err: unknown) => {
    const e = err instanceof Error ? err : new Error(String(err))
    results[i] = e
    errors.set(i, e)
  }

  /** Item i in its own sandbox; false when the map must stop (a fatal create error). */
  const one = async (i: number): Promise<boolean> => {
    let sb: Sandbox
    try {
      // not aborted mid-way (a create cut off after it was sent could leave a sandbox behind)
      sb = await Sandbox.create({ capacityWait: 600, ...create, metadata: meta[i] })
    } catch (err) {
      if (FATAL_CREATE_ERRORS.some((c) => err instanceof c)) {
        fatal ??= err as Error
        stop.abort(err)
        return false
      }
      fail(i, err)
      return true
    }
    try {
      await using box = sb
      if (stop.signal.aborted) {   // the map was stopped while this create was in flight: just kill it
        fail(i, new AbortError('map was stopped before this item ran', { cause: stop.signal.reason }))
      } else {
        results[i] = await fn(box, work[i]!, { index: i, signal: stop.signal })
      }
    } catch (err) {
      fail(i, err)
    }
    const info = sb.info   // the final record, stored by the kill on leaving the block
    Object.assign(perItem[i]!, { sandboxId: info.id, costUsd: info.costUsd, endReason: info.endReason ?? null,
      metadata: { ...info.metadata } })
    return true
  }

  const worker = async (): Promise<void> => {
    while (!stop.signal.aborted && next < work.length) {
      const i = next++
      const started = performance.now()
      if (!await one(i)) return
      const it = perItem[i]!
      it.duration = (performance.now() - started) / 1000
      it.error = errors.get(i) ?? null
      it.ok = it.error === null
      it.value = it.ok ? results[i] as R : null
      finished += 1
      onProgress?.({ done: finished, failed: errors.size, total: work.length })
    }
  }

  try {
    await Promise.all(Array.from({ length: Math.min(concurrency, work.length) }, worker))
  } finally {
    signal?.removeEventListener('abort', onAbort)
  }
  if (fatal) throw fatal
  if (signal?.aborted) throw new AbortError('map was aborted', { cause: signal.reason })
  return new MapResult(results, new Map([...errors].sort((a, b) => a[0] - b[0])), (performance.now() - t0) / 1000,
    perItem)
}
