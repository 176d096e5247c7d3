/**
 * One error tree for everything the SDK throws, mirroring `pilldrops/errors.py`: every error has the
 * server's stable machine `code`, the HTTP `status` it maps to, `details`, `requestId` and `retryable`.
 *
 * ```text
 * PillDropsError                       code, message, details, requestId, retryable
 * ├─ InvalidRequest        400 invalid_request
 * ├─ AuthenticationError   401 unauthenticated
 * ├─ PermissionDenied      403 permission_denied
 * │   └─ EgressForbidden   403 egress_forbidden   (the deployment gives no / less egress)
 * ├─ NotFound              404 not_found
 * │   ├─ SandboxNotFound   404 sandbox_not_found
 * │   ├─ FileNotFound      404 file_not_found
 * │   └─ TemplateNotFound  404 template_not_found
 * ├─ Conflict              409 conflict
 * │   └─ InvalidState      409 invalid_state       (details: from, to)
 * ├─ InsufficientCredits   402 insufficient_credits
 * ├─ PayloadTooLarge       413 payload_too_large
 * │   └─ DiskQuotaExceeded 413 disk_quota_exceeded
 * ├─ RateLimited           429 rate_limited        (retryable)
 * ├─ ServerError           500 internal            (retryable for idempotent calls)
 * ├─ NotSupported          501 not_supported
 * ├─ NodeUnavailable       502 node_unavailable    (retryable)
 * ├─ CapacityUnavailable   503 capacity_unavailable (retryable)
 * ├─ TemplateBuildFailed   422 template_build_failed
 * ├─ TransportError        —   no response at all  (retryable)
 * │   └─ RequestTimeout    —   client-side deadline
 * ├─ AbortError            —   the caller's AbortSignal fired (name "AbortError", cause: the signal's reason)
 * └─ CommandFailed         —   only from run(..., {check: true}) when exitCode != 0
 * ```
 */

export class PillDropsError extends Error {
  static readonly code: string = 'error'
  static readonly status: number = 500
  static readonly retryable: boolean = false

  /** The server's stable machine code (e.g. `sandbox_not_found`). */
  readonly code: string
  /** The HTTP status this error maps to (0 when no response was involved). */
  readonly status: number
  /** Whether retrying the same call may succeed. */
  readonly retryable: boolean
  details: unknown
  requestId: string | null
  /** Seconds the server asked to wait before a retry (its `Retry-After`), when it said. */
  retryAfter: number | null = null

  constructor(message = '', options: { details?: unknown; requestId?: string | null; cause?: unknown } = {}) {
    const ctor = new.target as typeof PillDropsError
    super(message || ctor.code, options.cause !== undefined ? { cause: options.cause } : undefined)
    this.name = ctor.name
    this.code = ctor.code
    this.status = ctor.status
    this.retryable = ctor.retryable
    this.details = options.details ?? null
    this.requestId = options.requestId ?? null
  }

  override toString(): string {
    return `${this.name}: ${this.message}${this.requestId ? ` (request_id=${this.requestId})` : ''}`
  }

  /** The wire form: `{"error": {code, message, details, request_id}}`. */
  toJSON(): { error: { code: string; message: string; details: unknown; request_id: string | null } } {
    return { error: { code: this.code, message: this.message, details: this.details, request_id: this.requestId } }
  }
}

export class InvalidRequest extends PillDropsError {
  static override readonly code = 'invalid_request'
  static override readonly status = 400
}
export class AuthenticationError extends PillDropsError {
  static override readonly code: string = 'unauthenticated'
  static override readonly status = 401
}
/** A sandbox port's URL without its token (`url_token_required`). */
export class URLTokenRequired extends AuthenticationError {
  static override readonly code = 'url_token_required'
}
/** A port URL's token that is forged, or another sandbox's or port's (`url_token_invalid`). */
export class URLTokenInvalid extends AuthenticationError {
  static override readonly code = 'url_token_invalid'
}
/** A port URL whose token has expired: ask for a new one with `getUrl` (`url_token_expired`). */
export class URLTokenExpired extends AuthenticationError {
  static override readonly code = 'url_token_expired'
}
export class PermissionDenied extends PillDropsError {
  static override readonly code: string = 'permission_denied'
  static override readonly status = 403
}
/** The create asks for egress the deployment does not give (`--no-egress`, or outside its `--egress-allow`). */
export class EgressForbidden extends PermissionDenied {
  static override readonly code = 'egress_forbidden'
}
export class NotFound extends PillDropsError {
  static override readonly code: string = 'not_found'
  static override readonly status = 404
}
export class SandboxNotFound extends NotFound {
  static override readonly code = 'sandbox_not_found'
}
export class FileNotFound extends NotFound {
  static override readonly code = 'file_not_found'
}
export class TemplateNotFound extends NotFound {
  static override readonly code = 'template_not_found'
}
export class Conflict extends PillDropsError {
  static override readonly code: string = 'conflict'
  static override readonly status = 409
}
/** An operation is illegal in the sandbox's current state; `details` is `{from, to}`. */
export class InvalidState extends Conflict {
  static override readonly code = 'invalid_state'
}
/** The team's credits are used up. */
export class InsufficientCredits extends PillDropsError {
  static override readonly code = 'insufficient_credits'
  static override readonly status = 402
}
export class PayloadTooLarge extends PillDropsError {
  static override readonly code: string = 'payload_too_large'
  static override readonly status = 413
}
/** An upload or file write does not fit in the sandbox's disk (`diskMb`); `details.free_bytes` is what is left. */
export class DiskQuotaExceeded extends PayloadTooLarge {
  static override readonly code = 'disk_quota_exceeded'
}
export class RateLimited extends PillDropsError {
  static override readonly code = 'rate_limited'
  static override readonly status = 429
  static override readonly retryable = true
}
export class ServerError extends PillDropsError {
  static override readonly code = 'internal'
  static override readonly status = 500
  static override readonly retryable = true
}
/** The operation exists but this deployment cannot do it (e.g. pause on a node without CRIU). */
export class NotSupported extends PillDropsError {
  static override readonly code = 'not_supported'
  static override readonly status = 501
}
export class NodeUnavailable extends PillDropsError {
  static override readonly code: string = 'node_unavailable'
  static override readonly status = 502
  static override readonly retryable = true
}
/** Nothing listens on that port inside the sandbox (`port_not_open`). */
export class PortNotOpen extends NodeUnavailable {
  static override readonly code = 'port_not_open'
}
/** A server inside a sandbox did not answer in time (`gateway_timeout`). */
export class GatewayTimeout extends PillDropsError {
  static override readonly code = 'gateway_timeout'
  static override readonly status = 504
}
export class CapacityUnavailable extends PillDropsError {
  static override readonly code = 'capacity_unavailable'
  static override readonly status = 503
  static override readonly retryable = true
}
/** A template build ran and failed (a step's exit status, a bad spec, a layer that did not verify). */
export class TemplateBuildFailed extends PillDropsError {
  static override readonly code = 'template_build_failed'
  static override readonly status = 422
}
/** No HTTP response was received (connection refused, reset, DNS, ...). */
export class TransportError extends PillDropsError {
  static override readonly code: string = 'transport_error'
  static override readonly status = 0
  static override readonly retryable = true
  /** True when the request provably never left this process (so even a non-idempotent call may be resent). */
  notSent = false
}
/** A client-side deadline (`requestTimeout`) passed before the answer came. */
export class RequestTimeout extends TransportError {
  static override readonly code = 'request_timeout'
}
/** The caller's `AbortSignal` fired; `cause` is the signal's reason. Named `AbortError` like the DOM's. */
export class AbortError extends PillDropsError {
  static override readonly code = 'aborted'
  static override readonly status = 0
}
/** Thrown by `run(cmd, {check: true})` when the command exits non-zero; `result` holds its output. */
export class CommandFailed extends PillDropsError {
  static override readonly code = 'command_failed'
  static override readonly status = 0
  result: unknown
  constructor(message = '', options: { result?: unknown; details?: unknown; requestId?: string | null } = {}) {
    super(message, options)
    this.result = options.result ?? null
  }
}

type ErrorClass = new (message?: string, options?: { details?: unknown; requestId?: string | null }) => PillDropsError

const ALL: (ErrorClass & typeof PillDropsError)[] = [
  InvalidRequest, AuthenticationError, PermissionDenied, EgressForbidden, NotFound, SandboxNotFound, FileNotFound,
  TemplateNotFound, Conflict, InvalidState, InsufficientCredits, PayloadTooLarge, RateLimited, ServerError,
  NodeUnavailable, CapacityUnavailable, NotSupported, TemplateBuildFailed, URLTokenRequired, URLTokenInvalid,
  URLTokenExpired, PortNotOpen, GatewayTimeout, DiskQuotaExceeded,
]
/** The error class of each stable code the server sends. */
export const BY_CODE: ReadonlyMap<string, ErrorClass> = new Map(ALL.map((c) => [c.code, c]))
const BY_STATUS: ReadonlyMap<number, ErrorClass> = new Map<number, ErrorClass>([
  [400, InvalidRequest], [401, AuthenticationError], [402, InsufficientCredits], [403, PermissionDenied],
  [404, NotFound], [409, Conflict], [413, PayloadTooLarge], [422, InvalidRequest], [429, RateLimited],
  [500, ServerError], [501, NotSupported], [502, NodeUnavailable], [503, CapacityUnavailable],
])

function isRecord(v: unknown): v is Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v)
}

/** The most specific error for an HTTP status and a decoded JSON body of any shape (code first, then status). */
export function fromWire(status: number, body: unknown): PillDropsError {
  const err = isRecord(body) && isRecord(body.error) ? body.error : {}
  const code = typeof err.code === 'string' ? err.code : ''
  const cls = BY_CODE.get(code) ?? BY_STATUS.get(status) ?? (status >= 500 ? ServerError : PillDropsError)
  const message = typeof err.message === 'string' ? err.message : `HTTP ${status}`
  const requestId = typeof err.request_id === 'string' ? err.request_id : null
  return new cls(message, { details: err.details ?? null, requestId })
}
