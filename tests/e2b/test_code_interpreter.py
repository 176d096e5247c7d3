"""`e2b-code-interpreter`'s `run_code` against our `code-interpreter` template, driven by the stock client
(sync and async): a real Jupyter kernel per context, state kept between calls, streamed stdout/stderr, the
last expression's result (with rich MIME types), errors with name/value/traceback, contexts, env vars,
and the control plane's bounds on what the sandbox sends back."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pilldrops.e2b.code_interpreter import ndjson_lines
from tests.e2b.conftest import Up

integration = pytest.mark.integration


@pytest.fixture(scope="module")
def ci(pd_up: Up) -> Iterator[Any]:
    """One stock ``e2b_code_interpreter.Sandbox`` for this module (a kernel start is seconds): each test
    uses its own variables or contexts."""
    saved = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith(("E2B_", "PILLDROPS_"))]}
    os.environ.update(pd_up.e2b_env)
    from e2b_code_interpreter import Sandbox
    sb = Sandbox.create()
    try:
        assert sb.run_code("1").text == "1"     # its kernel runs before the first test's leak snapshot
        yield sb
    finally:
        sb.kill()
        for k in pd_up.e2b_env:
            os.environ.pop(k, None)
        os.environ.update(saved)


@integration
def test_run_code_sync(ci: Any) -> None:
    sb = ci
    seen: list[str] = []
    ex = sb.run_code("import sys\nx = 41\nprint('out'); print('err', file=sys.stderr)\nx + 1",
                     on_stdout=lambda m: seen.append(m.line))
    assert ex.error is None and ex.text == "42"
    assert ex.logs.stdout == ["out\n"] and ex.logs.stderr == ["err\n"] and seen == ["out\n"]
    assert sb.run_code("x * 2").text == "82"                   # state survives between calls
    ex = sb.run_code("def f():\n    return 1 / 0\nf()")
    assert ex.error is not None and ex.error.name == "ZeroDivisionError"
    assert ex.error.value == "division by zero" and "ZeroDivisionError" in ex.error.traceback
    assert sb.run_code("x").text == "41"                        # an error keeps the kernel's state
    html = sb.run_code("from IPython.display import HTML, display\ndisplay(HTML('<b>hi</b>'))\n7")
    assert [r.html for r in html.results if not r.is_main_result] == ["<b>hi</b>"]
    assert html.text == "7"
    assert sb.run_code("import os; os.environ.get('PD_X')", envs={"PD_X": "v"}).text == "'v'"
    assert sb.run_code("import os; os.environ.get('PD_X')").text is None      # env only for that call
    assert sb.run_code("import os; os.getcwd()").text == "'/home/user'"


@integration
def test_contexts(ci: Any) -> None:
    sb = ci
    sb.run_code("a = 1")
    ctx = sb.create_code_context(cwd="/tmp")
    assert ctx.language == "python" and ctx.cwd == "/tmp"
    ex = sb.run_code("a", context=ctx)
    assert ex.error is not None and ex.error.name == "NameError"          # its own kernel
    sb.run_code("b = 2", context=ctx)
    assert sb.run_code("b", context=ctx).text == "2"
    assert ctx.id in [c.id for c in sb.list_code_contexts()]
    sb.restart_code_context(ctx)
    assert sb.run_code("b", context=ctx).error is not None                 # restarted: fresh state
    sb.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sb.list_code_contexts()]
    assert sb.run_code("a").text == "1"                                     # the default one is intact


@integration
@pytest.mark.anyio
async def test_run_code_async(ci: Any) -> None:
    from e2b_code_interpreter import AsyncSandbox
    sb = await AsyncSandbox.connect(ci.sandbox_id)          # the same sandbox, through the async client
    chunks: list[str] = []
    ex = await sb.run_code("import time\nfor i in range(3):\n    print(i, flush=True); time.sleep(0.2)\n'done'",
                           on_stdout=lambda m: chunks.append(m.line))
    assert ex.text == "'done'" and "".join(chunks) == "0\n1\n2\n"
    assert (await sb.run_code("i")).text == "2"


@integration
def test_execute_wire_and_auth(ci: Any, e2b_http: httpx.Client, pd_up: Up) -> None:
    """Wire level: NDJSON lines in order; X-Access-Token is required on /execute; a template without a
    kernel says so instead of hanging."""
    sb = e2b_http.get(f"/sandboxes/{ci.sandbox_id}").json()
    base = e2b_http.post("/v2/sandboxes", json={"templateID": "base"}).json()
    try:
        h = {"E2b-Sandbox-Id": sb["sandboxID"], "E2b-Sandbox-Port": "49999"}
        body = {"code": "print('a')\n3", "context_id": None, "language": None, "env_vars": None}
        r = httpx.post(f"{pd_up.api_url}/execute", json=body, headers=h, timeout=60)
        assert r.status_code == 401
        r = httpx.post(f"{pd_up.api_url}/execute", json=body, timeout=60,
                       headers={**h, "X-Access-Token": sb["envdAccessToken"]})
        assert r.status_code == 200
        lines = [json.loads(x) for x in r.text.splitlines()]
        assert all(lines) and [x["type"] for x in lines] == ["number_of_executions", "stdout", "result",
                                                            "end_of_execution"]
        assert lines[1]["text"] == "a\n" and lines[2]["text"] == "3" and lines[2]["is_main_result"] is True
        r = httpx.post(f"{pd_up.api_url}/execute", json={**body, "context_id": "nope"}, timeout=60,
                       headers={**h, "X-Access-Token": sb["envdAccessToken"]})
        assert r.status_code == 404
        hb = {"E2b-Sandbox-Id": base["sandboxID"], "E2b-Sandbox-Port": "49999",
              "X-Access-Token": base["envdAccessToken"]}
        r = httpx.post(f"{pd_up.api_url}/execute", json=body, headers=hb, timeout=60)
        assert r.status_code == 400 and "code-interpreter" in r.text
    finally:
        e2b_http.delete(f"/sandboxes/{base['sandboxID']}")


@integration
def test_interrupted_client_keeps_kernel(ci: Any) -> None:
    """A client that gives up (timeout) interrupts the running code; the kernel and its state stay."""
    sb = ci
    sb.run_code("kept = 'yes'")
    t = time.monotonic()
    from e2b.exceptions import TimeoutException
    with pytest.raises(TimeoutException):
        sb.run_code("import time\ntime.sleep(60)", timeout=2)
    assert time.monotonic() - t < 30
    t = time.monotonic()
    ex = sb.run_code("kept")          # waits for the interrupted cell: not for its whole minute
    assert ex.text == "'yes'" and time.monotonic() - t < 20


# ---- unit: what the sandbox sends is bounded and validated -------------------------------------------

async def _collect(chunks: list[bytes], max_line: int = 1024) -> list[dict]:
    async def gen():  # type: ignore[no-untyped-def]
        for c in chunks:
            yield c
    return [json.loads(x) async for x in ndjson_lines(gen(), max_line=max_line)]


@pytest.mark.anyio
async def test_ndjson_lines_split_and_blank() -> None:
    out = await _collect([b'{"type":"stdout","te', b'xt":"a"}\n\n{"type":"end_of_execution"}\n'])
    assert out == [{"type": "stdout", "text": "a"}, {"type": "end_of_execution"}]


@pytest.mark.anyio
async def test_ndjson_lines_rejects_garbage_and_huge_lines() -> None:
    out = await _collect([b'{"type":"stdout","text":"a"}\n', b"not json\n", b'{"type":"x"}\n'])
    assert [o["type"] for o in out] == ["stdout", "error"] and out[1]["name"] == "ProtocolError"
    out = await _collect([b'{"type":"stdout","text":"' + b"a" * 5000])        # never ends: bounded
    assert [o["name"] for o in out] == ["OutputTooLarge"]
    out = await _collect([b'[1,2]\n'])
    assert out[0]["name"] == "ProtocolError"
