/**
 * The SDK's public data types: the server's wire models (generated from its `/openapi.json` into
 * `generated/openapi.ts`) with camelCase keys. Times are ISO 8601 strings as on the wire; `metadata`
 * keys are kept exactly.
 */
import type { components } from './generated/openapi.js'

type Schemas = components['schemas']
/** `snake_case` to `camelCase`, at the type level. */
export type CamelCase<S extends string> = S extends `${infer H}_${infer T}` ? `${H}${Capitalize<CamelCase<T>>}` : S
/** An object type with camelCase keys. */
export type Camelize<T> = { [K in keyof T as K extends string ? CamelCase<K> : K]: T[K] }

export type SandboxState = Schemas['SandboxState']
export type EndReason = Schemas['EndReason']

/** One sandbox's record: shape, state, times, usage so far (final once ended) and cost. */
export interface SandboxInfo extends Omit<Camelize<Schemas['SandboxInfo']>, 'metadata'> {
  metadata: Record<string, string>
}
/** One paused interval (billed as storage only). */
export interface PauseInterval extends Camelize<Schemas['PauseInterval']> {}
/** One sandbox in the usage history (running ones with their cost so far). */
export interface HistoryRecord extends Omit<Camelize<Schemas['HistoryRecord']>, 'pauses' | 'metadata'> {
  metadata: Record<string, string>
  pauses: PauseInterval[]
}
/** The team's usage totals over a period and its credit balance (`creditsUsd` null when unlimited). */
export interface UsageSummary extends Camelize<Schemas['UsageSummary']> {}
/** One file or directory inside a sandbox. */
export interface FileInfo extends Camelize<Schemas['FileInfo']> {}
/** A URL to a port inside a sandbox (`expiresAt` null: a public port, no token). */
export interface PortURL extends Camelize<Schemas['PortURL']> {}
/** A template the nodes hold. */
export interface TemplateInfo extends Camelize<Schemas['TemplateInfo']> {}

export type WireSandboxInfo = Schemas['SandboxInfo']
export type WireCreateRequest = Schemas['CreateSandboxRequest']
export type WireBatchRequest = Schemas['BatchCreateRequest']
export type WireBatchResponse = Schemas['BatchCreateResponse']
export type WireSandboxList = Schemas['SandboxList']
export type WireHistoryPage = Schemas['HistoryPage']
export type WireUsageSummary = Schemas['UsageSummary']
export type WireRunRequest = Schemas['RunRequest']
export type WireRunEvent = Schemas['RunEvent']
export type WireFileInfo = Schemas['FileInfo']
export type WireFileList = Schemas['FileList']
export type WireArchiveUploaded = Schemas['ArchiveUploaded']
export type WireSetTimeoutRequest = Schemas['SetTimeoutRequest']
export type WireTemplateList = Schemas['TemplateList']
export type WirePortURL = Schemas['PortURL']
export type WireKillResponse = Schemas['KillSandboxesResponse']

/** One id's outcome of `Sandbox.killMany`: its final record, or why it was not killed. */
export interface KillItem {
  id: string
  sandbox: SandboxInfo | null
  error: { code: string, message: string, details?: unknown } | null
}

/** What `Sandbox.killMany` returns: every id's outcome, and the counts. */
export interface KillResult {
  items: KillItem[]
  killed: number
  failed: number
}

export const SANDBOX_STATES: readonly SandboxState[] = [
  'pending', 'starting', 'running', 'pausing', 'paused', 'resuming', 'stopping', 'stopped', 'failed', 'lost',
]

function camelKey(k: string): string {
  return k.replace(/_([a-z0-9])/g, (_m, c: string) => c.toUpperCase())
}

/** Top-level keys to camelCase (values untouched, so `metadata` keys stay as they are). */
export function camelize<T extends object>(obj: T): Camelize<T> {
  const out: Record<string, unknown> = {}
  for (const [k, v] of Object.entries(obj)) out[camelKey(k)] = v
  return out as Camelize<T>
}

export function toSandboxInfo(w: WireSandboxInfo): SandboxInfo {
  const info: SandboxInfo = { ...camelize(w), metadata: w.metadata ?? {} }
  // a secret: kept off console.log / JSON.stringify of the record (still readable as info.accessToken)
  Object.defineProperty(info, 'accessToken', { value: info.accessToken ?? null, enumerable: false, writable: true })
  return info
}

export function toHistoryRecord(w: Schemas['HistoryRecord']): HistoryRecord {
  const rec = camelize(w)
  return { ...rec, metadata: rec.metadata ?? {}, pauses: (w.pauses ?? []).map((p) => camelize(p)) }
}

/** What answers must hold before the SDK reads them (a malformed one is a `ServerError`, never a TypeError). */
const SANDBOX_KEYS = ['id', 'template', 'state', 'created_at'] as const
export const SHAPES = {
  sandbox: { keys: SANDBOX_KEYS },
  sandboxList: { keys: ['items'], itemKeys: SANDBOX_KEYS },
  batch: { keys: ['items'], itemKeys: ['index'] },
  kill: { keys: ['items', 'killed', 'failed'], itemKeys: ['id'] },
  history: { keys: ['items'], itemKeys: ['id', 'state'] },
  usage: { keys: ['team_id', 'sandboxes', 'cost_usd'] },
  file: { keys: ['name', 'path', 'type'] },
  portUrl: { keys: ['url', 'port'] },
  fileList: { keys: ['items'], itemKeys: ['name', 'path', 'type'] },
} as const
