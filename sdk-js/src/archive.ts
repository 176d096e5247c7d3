/**
 * Tar packing for `upload` and safe extraction for `download`, with the `tar` package (node-tar).
 * Same semantics as the Python SDK's `pack_upload` / `extract_download`.
 */
import { createReadStream } from 'node:fs'
import { cp, link, lstat, mkdir, mkdtemp, readdir, readlink, rename, rm, symlink, unlink, writeFile, copyFile, chmod }
  from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { basename, dirname, join, posix, resolve } from 'node:path'
import { Readable } from 'node:stream'

import * as tar from 'tar'

import { InvalidRequest, ServerError } from './errors.js'

/** A packed upload: the tar file on local disk, the remote directory to unpack it under, member count. */
export interface UploadPlan {
  tarPath: string
  dest: string
  entries: number
  /** Bytes of the tar file. */
  size: number
  /** A fresh stream of the tar file (one per attempt). */
  body(): ReadableStream<Uint8Array>
  cleanup(): Promise<void>
}

async function exists(path: string): Promise<Awaited<ReturnType<typeof lstat>> | null> {
  try {
    return await lstat(path)
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT' || (err as NodeJS.ErrnoException).code === 'ENOTDIR') {
      return null
    }
    throw err
  }
}

/** Stage `src` under `dir` as `name` without copying when a hard link works (a symlink stays a symlink). */
async function stageAs(src: string, dir: string, name: string): Promise<void> {
  const st = await lstat(src)
  const dst = join(dir, name)
  if (st.isSymbolicLink()) {
    await symlink(await readlink(src), dst)
    return
  }
  try {
    await link(src, dst)
  } catch {
    await copyFile(src, dst)
    await chmod(dst, st.mode & 0o7777)
  }
}

/**
 * Pack `local` (a file or a directory) into a temporary tar file for `PUT .../archive`.
 *
 * - a directory: its *contents* with names relative to it, unpacked under `remote` (so `remote` becomes the
 *   directory);
 * - a file: one member named `basename(remote)` unpacked under `dirname(remote)`; a `remote` ending in `/`
 *   is a directory and keeps the local file name.
 *
 * Symlinks are stored as symlinks, never followed; owners are dropped (portable). The caller must
 * `cleanup()` the plan.
 */
export async function packUpload(local: string, remote: string): Promise<UploadPlan> {
  const src = resolve(local)
  const st = await exists(src)
  if (!st) throw new InvalidRequest(`no such file or directory: ${local}`)
  if (!remote) throw new InvalidRequest('remote path must not be empty')
  const work = await mkdtemp(join(tmpdir(), 'pilldrops-upload-'))
  const tarPath = join(work, 'upload.tar')
  let entries = 0
  const count = () => {
    entries += 1
    return true
  }
  let dest: string
  try {
    if (st.isDirectory()) {
      dest = remote === '/' ? remote : remote.replace(/\/+$/, '') || '/'
      const names = (await readdir(src)).sort()
      if (names.length) {
        await tar.c({ file: tarPath, cwd: src, portable: true, follow: false, filter: count }, names)
      } else {
        await writeFile(tarPath, new Uint8Array(1024)) // an empty archive: two zero blocks
      }
    } else {
      let cwd = dirname(src)
      let arc: string
      if (remote.endsWith('/')) {
        dest = remote.replace(/\/+$/, '') || '/'
        arc = basename(src)
      } else {
        dest = posix.dirname(remote) || '.'
        arc = posix.basename(remote)
        if (arc !== basename(src)) {
          cwd = join(work, 'stage')
          await mkdir(cwd)
          await stageAs(src, cwd, arc)
        }
      }
      await tar.c({ file: tarPath, cwd, portable: true, follow: false, filter: count }, [arc])
    }
  } catch (err) {
    await rm(work, { recursive: true, force: true })
    if (err instanceof InvalidRequest) throw err
    throw new InvalidRequest(`could not pack ${local}: ${(err as Error).message}`, { cause: err })
  }
  const { size } = await lstat(tarPath)
  return {
    tarPath,
    dest,
    entries,
    size,
    body: () => Readable.toWeb(createReadStream(tarPath)) as ReadableStream<Uint8Array>,
    cleanup: () => rm(work, { recursive: true, force: true }),
  }
}

/** Why a member of a downloaded archive may not be extracted, or null when it is safe. */
export function unsafeMember(path: string, type: string, linkpath: string | undefined): string | null {
  const norm = posix.normalize(path)
  if (path.startsWith('/') || /^[A-Za-z]:/.test(path)) return `absolute member name ${JSON.stringify(path)}`
  if (norm === '..' || norm.startsWith('../')) return `member ${JSON.stringify(path)} leaves the destination`
  if (type === 'SymbolicLink' || type === 'Link') {
    const target = linkpath ?? ''
    if (target.startsWith('/')) return `link ${JSON.stringify(path)} points to the absolute path ${JSON.stringify(target)}`
    const resolved = type === 'Link' ? posix.normalize(target) : posix.normalize(posix.join(posix.dirname(norm), target))
    if (resolved === '..' || resolved.startsWith('../')) {
      return `link ${JSON.stringify(path)} points outside the destination (${JSON.stringify(target)})`
    }
    return null
  }
  if (['File', 'OldFile', 'ContiguousFile', 'Directory'].includes(type)) return null
  if (['ExtendedHeader', 'GlobalExtendedHeader', 'NextFileHasLongPath', 'NextFileHasLongLinkpath',
    'OldExtendedHeader'].includes(type)) return null
  return `member ${JSON.stringify(path)} is a ${type}, not a file, directory or link`
}

/**
 * Safely unpack a `GET .../archive` tar (holding `basename(remote)`) so that `local` becomes it. Absolute
 * names, `../` members, links out of the destination and device files are refused with
 * {@link InvalidRequest}; setuid/setgid bits are dropped. If `local` is an existing directory, a
 * downloaded directory is merged into it and a downloaded file is placed inside it. Returns the final path.
 */
export async function extractDownload(tarPath: string, remote: string, local: string): Promise<string> {
  const dst = resolve(local)
  await mkdir(dirname(dst), { recursive: true })
  let problem: string | null = null
  try {
    await tar.t({
      file: tarPath, strict: true,
      onReadEntry: (e) => { problem ??= unsafeMember(e.path, e.type, e.linkpath) },
    })
  } catch (err) {
    throw new ServerError(`the sandbox returned a broken archive: ${(err as Error).message}`, { cause: err })
  }
  if (problem) throw new InvalidRequest(`refusing unsafe archive from the sandbox: ${problem}`)
  let workdir: string | null = await mkdtemp(join(dirname(dst), '.pilldrops-extract-'))
  try {
    try {
      await tar.x({
        file: tarPath, cwd: workdir, strict: true, preservePaths: false, preserveOwner: false,
        filter: (_p, e) => {
          const entry = e as { mode?: number }
          if (typeof entry.mode === 'number') entry.mode &= 0o777
          return true
        },
      })
    } catch (err) {
      throw new ServerError(`the sandbox returned a broken archive: ${(err as Error).message}`, { cause: err })
    }
    const name = posix.basename(remote.replace(/\/+$/, ''))
    let top = name ? join(workdir, name) : workdir
    if (name && !(await exists(top))) {
      const found = await readdir(workdir)
      if (found.length !== 1) throw new ServerError(`archive for ${JSON.stringify(remote)} does not hold ${JSON.stringify(name)}`)
      top = join(workdir, found[0]!)
    }
    const dstStat = await exists(dst)
    const topStat = await lstat(top)
    if (dstStat?.isDirectory()) {
      if (topStat.isDirectory()) {
        await cp(top, dst, { recursive: true, force: true, verbatimSymlinks: true })
        return dst
      }
      const final = join(dst, basename(top))
      const finalStat = await exists(final)
      if (finalStat?.isDirectory()) await rm(final, { recursive: true, force: true })
      await rename(top, final)
      return final
    }
    if (dstStat) await unlink(dst)
    await rename(top, dst)
    if (top === workdir) workdir = null
    return dst
  } finally {
    if (workdir) await rm(workdir, { recursive: true, force: true })
  }
}
