/**
 * `@pilldrops/sdk`: disposable sandboxes for RL rollouts and evals.
 *
 * ```ts
 * import { Sandbox } from '@pilldrops/sdk'
 * await using sb = await Sandbox.create({ template: 'code-interpreter' })
 * const r = await sb.run('python -c "print(1 + 1)"')
 * ```
 */
export { Sandbox, BATCH_CHUNK, LIVE_STATES } from './sandbox.js'
export type {
  CallOptions, CreateManyOptions, CreateOptions, HistoryOptions, ListOptions, RunOptions, SandboxListOptions,
  UrlOptions, UsageOptions,
}
  from './sandbox.js'
export { Files, DEFAULT_MAX_READ_BYTES } from './files.js'
export type { ReadOptions } from './files.js'
export { map, MapResult } from './fanout.js'
export type { MapContext, MapOptions, MapProgress } from './fanout.js'
export { DEFAULT_OUTPUT_CAP, checkResult } from './run.js'
export type { RunResult } from './run.js'
export type { NetworkPolicy, SpecArgs, StateFilter, TimeArg } from './params.js'
export { DEFAULT_API_URL, configPath, resolveConfig } from './config.js'
export type { ClientConfig, ConnectionOptions } from './config.js'
export * from './errors.js'
export type {
  EndReason, FileInfo, HistoryRecord, KillItem, KillResult, PauseInterval, PortURL, SandboxInfo, SandboxState, TemplateInfo, UsageSummary,
} from './wire.js'
export { VERSION } from './version.js'
