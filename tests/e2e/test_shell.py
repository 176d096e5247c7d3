"""`pilldrops sandbox shell` / `exec -it` / `exec -d` + `logs` driven through the CLI on a real terminal
(pexpect gives the CLI a pty of its own) against a real `pilldrops up`: raw keys, window resize (SIGWINCH),
Ctrl-C reaching the sandbox's foreground job, the exit code."""

from __future__ import annotations

import sys
import time

import httpx
import pytest

pexpect = pytest.importorskip("pexpect")
pytestmark = pytest.mark.integration


@pytest.fixture
def box(api: httpx.Client):  # type: ignore[no-untyped-def]
    sid = api.post("/v1/sandboxes", json={"template": "tiny"}).raise_for_status().json()["id"]
    yield sid
    api.delete(f"/v1/sandboxes/{sid}")


def cli(server, *args: str, rows: int = 30, cols: int = 100):  # type: ignore[no-untyped-def]
    env = {"PILLDROPS_API_URL": server.api_url, "PILLDROPS_API_KEY": server.api_key, "TERM": "xterm",
           "PATH": "/usr/bin:/bin", "HOME": str(server.config_home), "XDG_CONFIG_HOME": str(server.config_home)}
    return pexpect.spawn(sys.executable, ["-m", "pilldrops", *args], env=env, dimensions=(rows, cols),
                         timeout=30, encoding="utf-8", codec_errors="replace")


def test_shell_resize_ctrl_c_exit_code(server, box):  # type: ignore[no-untyped-def]
    child = cli(server, "sandbox", "shell", box, "-e", "PS1=pd$ ")
    child.expect_exact("pd$ ")
    child.sendline("tty; stty size")
    child.expect(r"/dev/pts/\d+")
    child.expect_exact("30 100")
    child.setwinsize(40, 120)                # SIGWINCH to the CLI -> a resize message -> TIOCSWINSZ
    time.sleep(0.5)
    child.sendline("stty size")
    child.expect_exact("40 120")
    child.sendline("sleep 100")
    time.sleep(0.5)
    child.sendcontrol("c")                   # raw mode: 0x03 goes through; the sandbox's tty makes it SIGINT
    child.expect_exact("pd$ ")
    child.sendline("echo rc-$?")
    child.expect_exact("rc-130")
    child.sendline("exit 5")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 5


def test_exec_it_and_background_logs(server, box, api):  # type: ignore[no-untyped-def]
    child = cli(server, "sandbox", "exec", "-it", box, "--", "sh", "-c", "read x; echo got-$x; exit 3")
    time.sleep(1.0)
    child.sendline("hello")
    child.expect_exact("got-hello")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 3
    # -d: started in the background, its output kept for `logs`
    bg = cli(server, "sandbox", "exec", "-d", box, "--", "echo from-bg; echo err-bg >&2; sleep 30")
    bg.expect(r"(\d+)")
    pid = bg.match.group(1)
    bg.expect(pexpect.EOF)
    bg.close()
    assert bg.exitstatus == 0
    time.sleep(0.5)
    logs = cli(server, "sandbox", "logs", box)
    logs.expect_exact(f"pid {pid} (running)")
    logs.expect_exact("from-bg")
    logs.expect(pexpect.EOF)
    logs.close()
    assert logs.exitstatus == 0
    # the control plane proxies the process routes (API key instead of the access token)
    items = api.get(f"/v1/sandboxes/{box}/processes").raise_for_status().json()["items"]
    assert [p["pid"] for p in items if p["running"]] == [int(pid)]
    assert api.post(f"/v1/sandboxes/{box}/processes/{pid}/signal", json={"signal": "TERM"}).json() == {"delivered": True}
    out = api.get(f"/v1/sandboxes/{box}/processes/{pid}/output").raise_for_status().json()
    assert out["events"][0]["type"] in ("stdout", "stderr")
    assert api.get(f"/v1/sandboxes/{box}/fs/stat", params={"path": "/"}).json()["type"] == "dir"
    # logs -f follows a running process to its end
    bg = cli(server, "sandbox", "exec", "-d", box, "--", "sleep 4; for i in 1 2 3; do echo tick$i; sleep 0.3; done")
    bg.expect(r"(\d+)")
    pid = bg.match.group(1)
    bg.expect(pexpect.EOF)
    follow = cli(server, "sandbox", "logs", box, "--pid", pid, "-f")
    follow.expect_exact("tick3")
    follow.expect(pexpect.EOF)
    follow.close()
    assert follow.exitstatus == 0, follow.before


def test_shell_unknown_sandbox_fails_cleanly(server):  # type: ignore[no-untyped-def]
    child = cli(server, "sandbox", "shell", "sb_doesnotexist00000")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus != 0 and "Traceback" not in (child.before or "")
