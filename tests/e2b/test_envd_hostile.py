"""envd under hostile input: floods that nobody reads, oversized messages and envelopes, malformed uploads.
Nothing is buffered past its bound (the envd app runs in this test process: its RSS is what is measured)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import httpx
import pytest

from tests.e2b.envd_fixtures import *

pytestmark = pytest.mark.integration


def rss_mib() -> float:
    for ln in Path("/proc/self/status").read_text().splitlines():
        if ln.startswith("VmRSS:"):
            return int(ln.split()[1]) / 1024
    return 0.0


def test_unread_flood_is_bounded(e2b_debug):  # type: ignore[no-untyped-def]
    sb = e2b_debug
    before = rss_mib()
    h = sb.commands.run("yes flood-flood-flood-flood", background=True, timeout=0)   # its stream is never read
    time.sleep(3)
    grown = rss_mib() - before
    info = [p for p in sb.commands.list() if p.pid == h.pid]
    assert info, "the flooding process must still run (backpressure, not death)"
    assert sb.commands.kill(h.pid)
    print(f"envd process RSS growth with an unread flood for 3 s: {grown:.1f} MiB")
    assert grown < 64


def test_oversized_and_malformed_requests(envd):  # type: ignore[no-untyped-def]
    hdr = envd.rpc_headers()
    with httpx.Client(base_url=envd.url, timeout=30) as c:
        r = c.post("/process.Process/List", content=b"{" + b" " * (17 * 1024 * 1024) + b"}",
                   headers={**hdr, "Content-Type": "application/json"})
        assert r.status_code == 429 and r.json()["code"] == "resource_exhausted"
        # an envelope announcing 2 GiB: refused from its header, the stream ends with the error
        r = c.post("/process.Process/Start", content=struct.pack(">BI", 0, 2**31) + b"{}",
                   headers={**hdr, "Content-Type": "application/connect+json"})
        assert r.status_code == 200 and r.content[0] == 2
        assert json.loads(r.content[5:])["error"]["code"] == "resource_exhausted"
        r = c.post("/process.Process/List", content=b"{nope", headers={**hdr, "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
        assert c.post("/process.Process/List", content=b"{}", headers={**hdr, "Content-Type": "text/plain"}
                      ).status_code == 415
        # uploads: headers past the bound, no boundary, a truncated body, an octet-stream without a path
        big = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/x\"\r\nX: " + b"a" * 20000
        for body, ctype in [(big, "multipart/form-data; boundary=b"), (b"x", "multipart/form-data"),
                            (b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/t\"\r\n\r\nabc",
                             "multipart/form-data; boundary=b")]:
            r = c.post("/files", content=body, headers={**hdr, "Content-Type": ctype})
            assert r.status_code == 400, (r.status_code, r.text)
        r = c.post("/files", content=b"x", headers={**hdr, "Content-Type": "application/octet-stream"})
        assert r.status_code == 400
        # upstream's internal endpoints are not served
        assert c.post("/init", json={"accessToken": "x"}, headers=hdr).status_code == 404
