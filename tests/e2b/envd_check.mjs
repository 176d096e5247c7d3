// envd through the stock npm `e2b` client (debug mode: E2B_SANDBOX_URL is the envd under test); driven by
// tests/e2b/test_envd_js.py, which checks the lines this prints.
import { Sandbox } from 'e2b'
const sb = await Sandbox.create()
const r = await sb.commands.run('echo hi-js; echo err >&2')
console.log(JSON.stringify({stdout: r.stdout, stderr: r.stderr, code: r.exitCode}))
try { await sb.commands.run('exit 4') } catch (e) { console.log('exit-err', e.exitCode) }
const h = await sb.commands.run('read x; echo got-$x', {background: true, stdin: true})
await sb.commands.sendStdin(h.pid, 'js\n')
const w = await h.wait()
console.log('bg', w.stdout.trim())
await sb.files.write('/tmp/js/a.txt', 'from js')
console.log('read', await sb.files.read('/tmp/js/a.txt'))
console.log('list', (await sb.files.list('/tmp/js')).map(e => e.name + ':' + e.type).join(','))
console.log('exists', await sb.files.exists('/tmp/js/a.txt'), await sb.files.exists('/tmp/js/nope'))
console.log('info', (await sb.files.getInfo('/tmp/js/a.txt')).size)
console.log('mkdir', await sb.files.makeDir('/tmp/js/d'), await sb.files.makeDir('/tmp/js/d'))
await sb.files.rename('/tmp/js/a.txt', '/tmp/js/d/b.txt')
console.log('renamed', await sb.files.read('/tmp/js/d/b.txt'))
const events = []
const wh = await sb.files.watchDir('/tmp/js', (e) => events.push(e.type + ':' + e.name))
await sb.files.write('/tmp/js/w.txt', 'w')
await new Promise(r => setTimeout(r, 1500))
await wh.stop()
console.log('watch', events.join(','))
const k = await sb.commands.run('sleep 100', {background: true})
console.log('kill', await sb.commands.kill(k.pid))
const pty = await sb.pty.create({cols: 100, rows: 30, onData: (d) => { out += new TextDecoder().decode(d) }})
let out = ''
await sb.pty.sendInput(pty.pid, new TextEncoder().encode('stty size; exit 3\n'))
try { await pty.wait() } catch (e) { console.log('pty-exit', e.exitCode) }
console.log('pty', out.includes('30 100'))
await sb.files.remove('/tmp/js')
console.log('removed', await sb.files.exists('/tmp/js'))
