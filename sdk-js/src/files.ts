/** `sb.files`: read, write and list single files inside a sandbox (absolute paths only). */
import { posix } from 'node:path'

import { FileNotFound } from './errors.js'
import { checkRemotePath, sandboxPath } from './http.js'
import type { APIClient, Target } from './http.js'
import { SHAPES, camelize } from './wire.js'
import type { FileInfo, WireFileInfo, WireFileList } from './wire.js'

/** The most `files.read` / `files.readBytes` buffers by default (64 MiB); pass `maxBytes` for more. */
export const DEFAULT_MAX_READ_BYTES = 64 * 1024 * 1024

export interface ReadOptions {
  /** Most bytes to read; a larger file is a `PayloadTooLarge` error (default 64 MiB). */
  maxBytes?: number
  signal?: AbortSignal
}

/** What {@link Files} needs of its sandbox. */
export interface FilesOwner {
  readonly id: string
  readonly client: APIClient
  dataTarget(): Target
  dataCall<T>(call: () => Promise<T>): Promise<T>
}

/**
 * File access for one sandbox. A relative path is an `InvalidRequest` before any request.
 *
 * ```ts
 * await sb.files.write('/tmp/x.txt', 'hello')
 * await sb.files.read('/tmp/x.txt') // 'hello'
 * ```
 */
export class Files {
  constructor(private readonly owner: FilesOwner) {}

  private path(suffix: string): string {
    return sandboxPath(this.owner.id, suffix)
  }

  /** The file's raw bytes. Throws `FileNotFound`. */
  async readBytes(path: string, opts: ReadOptions = {}): Promise<Uint8Array> {
    checkRemotePath(path)
    const answer = await this.owner.dataCall(() => this.owner.client.request('GET', this.path('/files'), {
      target: this.owner.dataTarget(), params: [['path', path]], idempotent: true,
      maxBytes: opts.maxBytes ?? DEFAULT_MAX_READ_BYTES, signal: opts.signal,
    }))
    return answer.body
  }

  /** The file decoded as UTF-8 text (undecodable bytes become U+FFFD). Throws `FileNotFound`. */
  async read(path: string, opts: ReadOptions = {}): Promise<string> {
    return new TextDecoder('utf-8').decode(await this.readBytes(path, opts))
  }

  /** Create or replace the file with `data` (text is UTF-8 encoded); parent directories are created. */
  async write(path: string, data: string | Uint8Array, opts: { signal?: AbortSignal } = {}): Promise<FileInfo> {
    checkRemotePath(path)
    const body = typeof data === 'string' ? new TextEncoder().encode(data) : data
    const info = await this.owner.dataCall(() => this.owner.client.json<WireFileInfo>('PUT', this.path('/files'), {
      expect: SHAPES.file, target: this.owner.dataTarget(), params: [['path', path]], body: () => body,
      headers: { 'Content-Type': 'application/octet-stream' }, idempotent: true, signal: opts.signal,
    }))
    return camelize(info)
  }

  /** Entries of the directory `path`. Throws `FileNotFound`. */
  async list(path: string, opts: { signal?: AbortSignal } = {}): Promise<FileInfo[]> {
    checkRemotePath(path)
    const page = await this.owner.dataCall(() => this.owner.client.json<WireFileList>('GET', this.path('/files/list'), {
      expect: SHAPES.fileList, target: this.owner.dataTarget(), params: [['path', path]], idempotent: true,
      signal: opts.signal,
    }))
    return page.items.map((i) => camelize(i))
  }

  /** Whether a file, directory or symlink exists at `path`. */
  async exists(path: string, opts: { signal?: AbortSignal } = {}): Promise<boolean> {
    const norm = posix.normalize(checkRemotePath(path)).replace(/(.)\/+$/, '$1')
    const name = posix.basename(norm)
    if (!name) return true // "/" always exists
    try {
      const items = await this.list(posix.dirname(norm) || '/', opts)
      return items.some((i) => i.name === name)
    } catch (err) {
      if (err instanceof FileNotFound) return false
      throw err
    }
  }
}
