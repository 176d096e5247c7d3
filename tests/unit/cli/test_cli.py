"""Client CLI commands against the in-memory FakeControlPlane (installed as the SDK's transport)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from pilldrops.cli.main import cli, main
from pilldrops.sdk._config import transport_override
from pilldrops.sdk.testing import FakeControlPlane


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeControlPlane]:
    fake = FakeControlPlane()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    monkeypatch.setenv("PILLDROPS_API_URL", fake.api_url)
    monkeypatch.setenv("PILLDROPS_API_KEY", fake.api_key)
    with transport_override(fake.transport):
        yield fake


def run(*args: str, **kw: Any) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False, **kw)


def test_create_get_kill(fake: FakeControlPlane) -> None:
    res = run("sandbox", "create", "--template", "code-interpreter", "--vcpu", "2", "--memory-mb", "256",
              "-m", "exp=a", "--env", "X=1")
    assert res.exit_code == 0, res.output
    sid = res.output.strip()
    sb = fake.sandboxes[sid]
    assert (sb.info.template, sb.info.vcpu, sb.info.memory_mb, sb.info.metadata, sb.envs) == \
        ("code-interpreter", 2, 256, {"exp": "a"}, {"X": "1"})
    got = json.loads(run("sandbox", "get", sid, "--json").output)
    assert got["id"] == sid and got["state"] == "running"
    assert sid in run("sandbox", "get", sid).output
    assert run("sandbox", "kill", sid).output.strip() == f"killed {sid}"
    assert fake.sandboxes[sid].info.state.value == "stopped"


def test_create_json(fake: FakeControlPlane) -> None:
    info = json.loads(run("sandbox", "create", "--json").output)
    assert info["id"] in fake.sandboxes and info["template"] == "base"


def test_list_json_and_table(fake: FakeControlPlane) -> None:
    ids = [run("sandbox", "create", "-m", f"i={i}").output.strip() for i in range(3)]
    run("sandbox", "kill", ids[0])
    listed = json.loads(run("sandbox", "list", "--json").output)
    assert isinstance(listed, list) and [s["id"] for s in listed] == ids[::-1]
    running = json.loads(run("sandbox", "list", "--state", "running", "--json").output)
    assert {s["id"] for s in running} == set(ids[1:])
    one = json.loads(run("sandbox", "list", "-m", "i=2", "--json").output)
    assert [s["id"] for s in one] == [ids[2]]
    table = run("sandbox", "list").output
    assert all(i in table for i in ids) and "STATE" in table
    assert json.loads(run("sandbox", "list", "--state", "paused", "--json").output) == []


def test_exec_streams_and_exits_with_the_command_code(fake: FakeControlPlane) -> None:
    sid = run("sandbox", "create").output.strip()
    res = CliRunner().invoke(cli, ["sandbox", "exec", sid, "--", "echo out; echo err >&2; exit 7"])
    assert res.exit_code == 7 and res.stdout == "out\n" and res.stderr == "err\n"
    res = run("sandbox", "exec", sid, "--", "echo", "-n", "a b")
    assert res.exit_code == 0 and res.output == "a b"


def test_upload_download(fake: FakeControlPlane, tmp_path: Path) -> None:
    sid = run("sandbox", "create").output.strip()
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "f.txt").write_text("F")
    res = run("sandbox", "upload", sid, str(tmp_path / "env"), "/env")
    assert res.exit_code == 0 and "1 entry" in res.output
    assert fake.sandboxes[sid].files["/env/f.txt"] == b"F"
    res = run("sandbox", "download", sid, "/env", str(tmp_path / "back"))
    assert res.exit_code == 0 and (tmp_path / "back" / "f.txt").read_text() == "F"


def test_errors_are_red_messages_with_exit_1(fake: FakeControlPlane) -> None:
    res = CliRunner().invoke(cli, ["sandbox", "get", "sb_nope"])
    assert res.exit_code == 1
    assert "Error:" in res.stderr and "sb_nope" in res.stderr and "sandbox_not_found" in res.stderr
    assert "Traceback" not in res.stderr
    res = CliRunner().invoke(cli, ["--debug", "sandbox", "get", "sb_nope"])
    assert res.exit_code == 1 and "Traceback" in res.stderr


def test_usage_errors_exit_2(fake: FakeControlPlane) -> None:
    assert CliRunner().invoke(cli, ["sandbox", "create", "--metadata", "novalue"]).exit_code == 2
    assert CliRunner().invoke(cli, ["sandbox", "nope"]).exit_code == 2


def test_no_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    for var in ("PILLDROPS_API_KEY", "E2B_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    res = CliRunner().invoke(cli, ["sandbox", "list"])
    assert res.exit_code == 1 and "pilldrops up" in res.stderr


def test_global_options_override_env(fake: FakeControlPlane) -> None:
    res = CliRunner().invoke(cli, ["--api-key", "wrong", "sandbox", "list"])
    assert res.exit_code == 1 and "unauthenticated" in res.stderr


def test_keys(fake: FakeControlPlane) -> None:
    created = json.loads(run("keys", "create", "--name", "ci", "--json").output)
    assert created["name"] == "ci" and created["secret"]
    plain = run("keys", "create")
    assert plain.exit_code == 0 and plain.stdout.strip().startswith("pd_")
    listed = json.loads(run("keys", "list", "--json").output)
    assert created["id"] in {k["id"] for k in listed} and all("secret" not in k for k in listed)
    assert "ci" in run("keys", "list").output
    assert run("keys", "revoke", created["id"]).output.strip() == f"revoked {created['id']}"
    revoked = [k for k in json.loads(run("keys", "list", "--json").output) if k["id"] == created["id"]]
    assert revoked[0]["revoked_at"]


def test_templates(fake: FakeControlPlane) -> None:
    names = [t["name"] for t in json.loads(run("template", "list", "--json").output)]
    assert names == ["base", "code-interpreter"]
    assert "code-interpreter" in run("template", "list").output


def test_help_hides_test_hooks_and_lists_commands() -> None:
    out = CliRunner().invoke(cli, ["--help"]).output
    assert "transport" not in out.lower()
    for name in ("sandbox", "keys", "template"):
        assert name in out
    sub = CliRunner().invoke(cli, ["sandbox", "--help"]).output
    for name in ("create", "list", "get", "exec", "upload", "download", "kill"):
        assert name in sub


def test_main_exit_codes(fake: FakeControlPlane, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["sandbox", "get", "sb_nope"])
    assert info.value.code == 1 and "Error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["sandbox", "get"])
    assert usage.value.code == 2
