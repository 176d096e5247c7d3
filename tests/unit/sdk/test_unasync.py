from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "unasync.py"


def _load():
    spec = importlib.util.spec_from_file_location("unasync", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_sync_code_is_up_to_date() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], check=False, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_substitutions() -> None:
    src = (
        "import anyio\n"
        "from pilldrops.sdk._async.client import AsyncAPIClient\n"
        "class AsyncFoo:\n"
        "    async def __aenter__(self): ...\n"
        "    @pytest.mark.anyio\n"
        "    async def go(self, c: httpx.AsyncClient):\n"
        "        async with c.stream() as r:\n"
        "            async for line in r.aiter_lines():\n"
        "                await r.aread()\n"
        "        await anyio.sleep(1)\n"
        "        raise StopAsyncIteration\n"
        "        await r.aclose()\n"
    )
    out = _load().unasync_text(src)
    assert out.startswith("# DO NOT EDIT — generated from _async by scripts/unasync.py\n")
    body = out.split("\n", 1)[1]
    assert body == (
        "import time\n"
        "from pilldrops.sdk._sync.client import APIClient\n"
        "class Foo:\n"
        "    def __enter__(self): ...\n"
        "    def go(self, c: httpx.Client):\n"
        "        with c.stream() as r:\n"
        "            for line in r.iter_lines():\n"
        "                r.read()\n"
        "        time.sleep(1)\n"
        "        raise StopIteration\n"
        "        r.close()\n"
    )


def test_check_detects_a_hand_edit(tmp_path: Path, monkeypatch) -> None:
    mod = _load()
    src, dst = tmp_path / "a", tmp_path / "s"
    src.mkdir()
    (src / "m.py").write_text("async def f(): await g()\n")
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    monkeypatch.setattr(mod, "DIRS", [("a", "s")])
    assert mod.main([]) == 0 and (dst / "m.py").read_text().endswith("def f(): g()\n")
    (dst / "m.py").write_text("edited\n")
    assert mod.main(["--check"]) == 1
    (dst / "extra.py").write_text("x\n")
    assert mod.main([]) == 0 and not (dst / "extra.py").exists() and mod.main(["--check"]) == 0
