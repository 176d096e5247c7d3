/** The retry decision and backoff of one logical request, exactly as in the Python SDK (`sdk/_base.py`). */
import { InvalidRequest, PillDropsError, TransportError } from './errors.js'

export const RETRY_STATUSES: ReadonlySet<number> = new Set([429, 500, 502, 503])
export const BACKOFF_BASE_S = 0.25
export const BACKOFF_CAP_S = 4
export const MAX_RETRY_AFTER_S = 60
export const CAPACITY_BACKOFF_BASE_S = 0.5
export const CAPACITY_BACKOFF_CAP_S = 10

/**
 * Whether a failed attempt may be repeated. Idempotent calls retry on transport errors and on
 * 429/500/502/503; other calls (`run`, `upload`, pause/resume) only when the request provably never left
 * this process (connection refused, DNS failure).
 */
export function shouldRetry(err: PillDropsError, idempotent: boolean): boolean {
  if (err instanceof TransportError) return idempotent || err.notSent
  return idempotent && RETRY_STATUSES.has(err.status)
}

/** Seconds from a `Retry-After` header (delta-seconds or an HTTP date), or null. */
export function parseRetryAfter(value: string | null | undefined, now: number = Date.now()): number | null {
  if (!value) return null
  const v = value.trim()
  if (/^\d+(\.\d+)?$/.test(v)) return Math.max(0, Number(v))
  const when = Date.parse(v)
  if (Number.isNaN(when)) return null
  return Math.max(0, (when - now) / 1000)
}

/** Seconds before retry number `attempt` (0-based): exponential with jitter, capped; `Retry-After` wins (up to 60 s). */
export function backoffDelay(attempt: number, retryAfter: number | null = null, base = BACKOFF_BASE_S,
                             cap = BACKOFF_CAP_S, random: () => number = Math.random): number {
  if (retryAfter !== null) return Math.min(retryAfter, MAX_RETRY_AFTER_S)
  const delay = Math.min(cap, base * 2 ** attempt)
  return delay * (0.5 + 0.5 * random())
}

/** No room right now (503 `capacity_unavailable` or 429 `rate_limited`): worth waiting for. */
export function isCapacityError(err: PillDropsError): boolean {
  return err.code === 'capacity_unavailable' || err.status === 429
}

/** `capacityWait` must be a finite number of seconds >= 0. */
export function checkCapacityWait(value: number): number {
  if (typeof value !== 'number' || !Number.isFinite(value) || value < 0) {
    throw new InvalidRequest(`capacityWait must be a number of seconds >= 0, got ${String(value)}`)
  }
  return value
}

/**
 * Failure after failure of one logical request: whether to send it again and after how long (seconds).
 * Ordinary failures follow {@link shouldRetry} for at most `maxRetries` retries. With a `capacityWait`
 * (a create), capacity failures of an idempotent request are retried with backoff (`Retry-After`
 * honoured) for as long as the delays slept for them add up to at most `capacityWait` seconds.
 */
export class RetryPolicy {
  retries = 0
  capacityRetries = 0
  capacityWaited = 0

  constructor(readonly maxRetries: number, readonly idempotent: boolean,
              readonly capacityWait: number | null = null, readonly random: () => number = Math.random) {}

  nextDelay(err: PillDropsError, retryAfter: number | null): number | null {
    if (this.capacityWait !== null && this.idempotent && isCapacityError(err)) {
      const remaining = this.capacityWait - this.capacityWaited
      if (remaining <= 0) return null
      const delay = Math.min(remaining, backoffDelay(this.capacityRetries, retryAfter, CAPACITY_BACKOFF_BASE_S,
        CAPACITY_BACKOFF_CAP_S, this.random))
      this.capacityRetries += 1
      this.capacityWaited += delay
      return delay
    }
    if (this.retries >= this.maxRetries || !shouldRetry(err, this.idempotent)) return null
    const delay = backoffDelay(this.retries, retryAfter, BACKOFF_BASE_S, BACKOFF_CAP_S, this.random)
    this.retries += 1
    return delay
  }
}
