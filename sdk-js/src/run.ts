/** Decoding a streamed run (`POST .../run`, NDJSON events) into callbacks and a {@link RunResult}. */
import { CommandFailed, ServerError, TransportError, fromWire } from './errors.js'
import { concat } from './http.js'
import type { WireRunEvent } from './wire.js'

/** Default cap on each of stdout and stderr (16 MiB), like the server's. */
export const DEFAULT_OUTPUT_CAP = 16 * 1024 * 1024

/** What a finished command produced. */
export interface RunResult {
  /** The exit code: 124 when it timed out, 128+N when killed by signal N, 137 when ended by a pause. */
  exitCode: number
  /** stdout decoded as UTF-8 (undecodable bytes become U+FFFD). */
  stdout: string
  stderr: string
  /** The raw bytes of stdout (at most `maxOutputBytes`). */
  stdoutBytes: Uint8Array
  stderrBytes: Uint8Array
  /** Seconds the command ran. */
  duration: number
  /** Output passed `maxOutputBytes` and the rest was dropped. */
  truncated: boolean
  /** The command hit its `timeout` (exitCode is then 124). */
  timedOut: boolean
  /** The sandbox was paused while the command ran, which ended it (exitCode 137). */
  paused: boolean
  /** The sandbox's memory limit (`memoryMb`) killed the command or one of its processes (exitCode 137). */
  oomKilled: boolean
  /** `exitCode === 0`. */
  ok: boolean
  /** The in-sandbox pid of the command, when the node reported it. */
  pid: number | null
  cmd: string | string[]
}

/** Throw {@link CommandFailed} (with `.result`) when the result's exit code is not 0; else return it. */
export function checkResult(r: RunResult): RunResult {
  if (r.exitCode === 0) return r
  const what = r.timedOut ? 'timed out' : r.paused ? 'was ended by a pause of its sandbox'
    : r.oomKilled ? "was killed by the sandbox's memory limit (memoryMb)" : `exited with code ${r.exitCode}`
  const tail = r.stderr.trim().split('\n').pop() ?? ''
  throw new CommandFailed(`command ${JSON.stringify(r.cmd)} ${what}${tail ? `: ${tail.slice(0, 300)}` : ''}`,
    { result: r })
}

class OutputStream {
  readonly chunks: Uint8Array[] = []
  size = 0
  truncated = false
  private readonly decoder = new TextDecoder('utf-8')

  constructor(private readonly callback: ((text: string) => unknown) | undefined, private readonly cap: number) {}

  feed(data: Uint8Array): void {
    const room = this.cap - this.size
    if (data.byteLength > room) {
      data = data.subarray(0, Math.max(room, 0))
      this.truncated = true
    }
    if (!data.byteLength) return
    this.chunks.push(data)
    this.size += data.byteLength
    if (this.callback) {
      const text = this.decoder.decode(data, { stream: true })
      if (text) this.callback(text)
    }
  }

  finish(): Uint8Array {
    if (this.callback) {
      const tail = this.decoder.decode()
      if (tail) this.callback(tail)
    }
    return concat(this.chunks, this.size)
  }
}

const B64 = /^[A-Za-z0-9+/]*={0,2}$/

/**
 * Feed it each NDJSON line with {@link feed}; an `error` event throws the matching PillDrops error.
 * Callbacks get decoded text chunks (a multi-byte character split across chunks is decoded whole); each
 * stream keeps at most `maxOutputBytes` bytes.
 */
export class RunDecoder {
  pid: number | null = null
  private readonly out: OutputStream
  private readonly err: OutputStream
  private exit: WireRunEvent | null = null

  constructor(readonly cmd: string | string[], opts: {
    onStdout?: (text: string) => unknown
    onStderr?: (text: string) => unknown
    maxOutputBytes?: number
  } = {}) {
    const cap = opts.maxOutputBytes ?? DEFAULT_OUTPUT_CAP
    this.out = new OutputStream(opts.onStdout, cap)
    this.err = new OutputStream(opts.onStderr, cap)
  }

  get done(): boolean {
    return this.exit !== null
  }

  feed(line: string): void {
    if (!line.trim()) return
    let event: WireRunEvent
    try {
      event = JSON.parse(line) as WireRunEvent
    } catch {
      throw new ServerError(`malformed run event: ${JSON.stringify(line.slice(0, 200))}`)
    }
    if (typeof event !== 'object' || event === null || typeof event.type !== 'string') {
      throw new ServerError(`malformed run event: ${JSON.stringify(line.slice(0, 200))}`)
    }
    switch (event.type) {
      case 'start':
        this.pid = typeof event.pid === 'number' ? event.pid : null
        break
      case 'stdout':
      case 'stderr': {
        const data = event.data ?? ''
        if (typeof data !== 'string' || data.length % 4 !== 0 || !B64.test(data)) {
          throw new ServerError('malformed base64 in run output')
        }
        ;(event.type === 'stdout' ? this.out : this.err).feed(new Uint8Array(Buffer.from(data, 'base64')))
        break
      }
      case 'exit':
        this.exit = event
        break
      case 'error':
        throw fromWire(0, { error: { code: event.code, message: event.message || event.code } })
      default:
        throw new ServerError(`unknown run event type ${JSON.stringify(event.type)}`)
    }
  }

  /** The final result; a {@link TransportError} if the stream ended without an `exit` event. */
  result(): RunResult {
    const out = this.out.finish()
    const err = this.err.finish()
    if (this.exit === null) throw new TransportError("the run stream ended before the command's exit was reported")
    const ev = this.exit
    const exitCode = typeof ev.exit_code === 'number' ? ev.exit_code : -1
    const dec = new TextDecoder('utf-8')
    return {
      exitCode,
      stdout: dec.decode(out),
      stderr: dec.decode(err),
      stdoutBytes: out,
      stderrBytes: err,
      duration: Number(ev.duration ?? 0),
      truncated: Boolean(ev.truncated) || this.out.truncated || this.err.truncated,
      timedOut: Boolean(ev.timed_out),
      paused: Boolean(ev.paused),
      oomKilled: Boolean(ev.oom_killed),
      ok: exitCode === 0,
      pid: this.pid,
      cmd: this.cmd,
    }
  }
}
