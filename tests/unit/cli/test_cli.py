"""Client CLI commands against the in-memory FakeControlPlane (installed as the SDK's transport)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from pilldrops.cli._output import fmt_usd
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


def test_public_ports_and_url(fake: FakeControlPlane) -> None:
    sid = run("sandbox", "create", "--public-port", "8080", "--public-port", "81").output.strip()
    assert fake.sandboxes[sid].info.public_ports == [81, 8080] and not fake.sandboxes[sid].info.public
    url = run("sandbox", "url", sid, "9000", "--expires-in", "60", "--path", "/x?y=1").output.strip()
    assert url.startswith(f"{fake.api_url}:82/ports/{sid}/9000/x?y=1&pd_token=")   # the ports listener
    info = json.loads(run("sandbox", "url", sid, "8080", "--json").output)
    assert info == {"url": f"{fake.api_url}:82/ports/{sid}/8080/", "port": 8080, "expires_at": None, "public": True}
    assert run("sandbox", "url", sid, "70000").exit_code == 2          # a usage error, before any request
    assert fake.sandboxes[run("sandbox", "create", "--public").output.strip()].info.public


def test_list_json_and_table(fake: FakeControlPlane) -> None:
    ids = [run("sandbox", "create", "-m", f"i={i}").output.strip() for i in range(3)]
    run("sandbox", "kill", ids[0])
    listed = json.loads(run("sandbox", "list", "--json").output)  # live ones only by default
    assert isinstance(listed, list) and [s["id"] for s in listed] == ids[:0:-1]
    everything = json.loads(run("sandbox", "list", "--all", "--json").output)
    assert [s["id"] for s in everything] == ids[::-1]
    running = json.loads(run("sandbox", "list", "--state", "running", "--json").output)
    assert {s["id"] for s in running} == set(ids[1:])
    stopped = json.loads(run("sandbox", "list", "--state", "stopped", "--json").output)
    assert [s["id"] for s in stopped] == [ids[0]]
    one = json.loads(run("sandbox", "list", "-m", "i=2", "--json").output)
    assert [s["id"] for s in one] == [ids[2]]
    table = run("sandbox", "list").output
    assert all(i in table for i in ids[1:]) and ids[0] not in table and "STATE" in table
    table = run("sandbox", "list", "--all").output
    assert all(i in table for i in ids)
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
    positional = json.loads(run("keys", "create", "trainer", "--json").output)
    assert positional["name"] == "trainer"
    assert json.loads(run("keys", "create", "--json").output)["name"] == "default"
    assert CliRunner().invoke(cli, ["keys", "create", "a", "--name", "b"]).exit_code == 2
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
    for name in ("sandbox", "keys", "template", "history", "usage"):
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


# ---------------------------------------------------------------------------------------------- billing


def _three_sandboxes(fake: FakeControlPlane) -> list[str]:
    ids = [run("sandbox", "create", "--template", t, "--vcpu", "2", "--memory-mb", "1024", "-m", f"i={i}")
           .output.strip() for i, t in enumerate(("base", "code-interpreter", "base"))]
    fake.advance(10)
    run("sandbox", "kill", ids[0])
    return ids


def test_history_json_is_an_array_of_records(fake: FakeControlPlane) -> None:
    ids = _three_sandboxes(fake)
    records = json.loads(run("history", "--json").output)
    assert isinstance(records, list) and [r["id"] for r in records] == ids[::-1]
    oldest = records[-1]
    assert set(oldest) >= {"id", "template", "vcpu", "memory_mb", "vcpu_s", "gb_s", "storage_gb_s", "cost_usd",
                           "started_at", "ended_at", "state", "end_reason", "metadata"}
    assert (oldest["state"], oldest["end_reason"], oldest["metadata"]) == ("stopped", "killed", {"i": "0"})
    assert oldest["vcpu_s"] == pytest.approx(20, abs=0.01) and oldest["gb_s"] == pytest.approx(10, abs=0.01)
    assert oldest["cost_usd"] == pytest.approx(20 * 0.000014 + 10 * 0.0000045, rel=1e-3)
    assert all(isinstance(r["cost_usd"], float) and r["cost_usd"] > 0 for r in records)


def test_history_filters(fake: FakeControlPlane) -> None:
    ids = _three_sandboxes(fake)

    def listed(*args: str) -> list[str]:
        res = run("history", "--json", *args)
        assert res.exit_code == 0, res.output
        return [r["id"] for r in json.loads(res.output)]

    assert listed("--state", "running") == [ids[2], ids[1]]
    assert listed("--state", "stopped", "--state", "running") == ids[::-1]
    assert listed("--template", "code-interpreter") == [ids[1]]
    assert listed("--metadata", "i=2") == [ids[2]]
    assert listed("--limit", "1") == [ids[2]]
    created = fake.sandboxes[ids[1]].info.created_at.isoformat()
    assert listed("--since", created) == [ids[2], ids[1]]
    assert listed("--until", created) == [ids[0]]
    assert listed("--since", "2100-01-01") == []
    sent = [r.url.params["since"] for r in fake.requests_to("GET", "/v1/history") if "since" in r.url.params]
    assert sent and all(v.endswith("Z") for v in sent)  # sent as UTC


def test_history_table_has_a_total_line(fake: FakeControlPlane) -> None:
    ids = _three_sandboxes(fake)
    res = run("history", env={"COLUMNS": "200"})
    assert res.exit_code == 0
    for sid in ids:
        assert sid in res.output
    for header in ("TEMPLATE", "VCPU_S", "GB_S", "COST_USD", "END_REASON", "killed", "running"):
        assert header in res.output
    total = [line for line in res.output.splitlines() if line.startswith("TOTAL")]
    records = json.loads(run("history", "--json").output)
    cost = sum(r["cost_usd"] for r in records)
    expected = (f"TOTAL  3 sandboxes  vcpu_s {sum(r['vcpu_s'] for r in records):.1f}"
                f"  gb_s {sum(r['gb_s'] for r in records):.1f}  storage_gb_s 0.0  cost_usd {fmt_usd(cost)}")
    assert total == [expected]
    empty = run("history", "--since", "2100-01-01")
    assert "no sandboxes" in empty.output and "TOTAL" not in empty.output


def test_history_usage_errors_exit_2(fake: FakeControlPlane) -> None:
    for args in (["history", "--since", "yesterday"], ["history", "--limit", "0"], ["history", "-m", "x"],
                 ["usage", "--until", "soon"]):
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2, args
    assert fake.requests_to("GET", "/v1/(history|usage)") == []


def test_usage(fake: FakeControlPlane) -> None:
    _three_sandboxes(fake)
    summary = json.loads(run("usage", "--json").output)
    assert summary["team_id"] == fake.team_id and summary["sandboxes"] == 3
    assert summary["vcpu_s"] == pytest.approx(60, abs=0.01)
    assert summary["credits_usd"] == pytest.approx(5.0 - summary["cost_usd"]) and not summary["credits_unlimited"]
    table = run("usage").output
    assert "all time" in table and fmt_usd(summary["cost_usd"]) in table
    assert fmt_usd(summary["credits_usd"]) in table
    later = json.loads(run("usage", "--json", "--since", "2100-01-01T00:00:00Z").output)
    assert later["sandboxes"] == 0 and later["since"].startswith("2100-01-01")
    assert "since 2100-01-01 00:00" in run("usage", "--since", "2100-01-01").output


def test_usage_unlimited_credits(fake: FakeControlPlane) -> None:
    fake.credits_usd = None
    assert json.loads(run("usage", "--json").output)["credits_usd"] is None
    line = [ln for ln in run("usage").output.splitlines() if "credits_usd" in ln]
    assert len(line) == 1 and "unlimited" in line[0]


def test_sandbox_get_shows_usage_and_credits_errors_are_reported(fake: FakeControlPlane) -> None:
    sid = run("sandbox", "create").output.strip()
    fake.advance(60)
    got = json.loads(run("sandbox", "get", sid, "--json").output)
    assert got["vcpu_s"] == pytest.approx(60) and got["cost_usd"] > 0
    table = run("sandbox", "get", sid).output
    for name in ("vcpu_s", "gb_s", "storage_gb_s", "cost_usd"):
        assert name in table
    fake.credits_usd = 0.0
    res = CliRunner().invoke(cli, ["sandbox", "create"])
    assert res.exit_code == 1 and "insufficient_credits" in res.stderr


def test_list_and_history_unknown_state_lists_the_valid_ones(fake: FakeControlPlane) -> None:
    for args in (["sandbox", "list", "--state", "bogus"], ["history", "--state", "bogus"]):
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2
        assert "bogus" in res.stderr and all(s in res.stderr for s in ("running", "paused", "stopped"))
    assert CliRunner().invoke(cli, ["sandbox", "list", "--all", "--state", "running"]).exit_code == 2
    assert run("sandbox", "list", "--state", "RUNNING").exit_code == 0


def test_exec_passes_piped_stdin_through(fake: FakeControlPlane) -> None:
    sid = run("sandbox", "create").output.strip()
    res = CliRunner().invoke(cli, ["sandbox", "exec", sid, "--", "cat"], input="hi\nthere\n")
    assert res.exit_code == 0 and res.stdout == "hi\nthere\n"
    res = CliRunner().invoke(cli, ["sandbox", "exec", sid, "--no-stdin", "--", "cat"], input="hi\n")
    assert res.exit_code == 0 and res.stdout == ""
    res = CliRunner().invoke(cli, ["sandbox", "exec", sid, "--", "echo", "no input"])
    assert res.exit_code == 0 and res.stdout == "no input\n"


def test_exec_reports_a_timeout(fake: FakeControlPlane) -> None:
    sid = run("sandbox", "create").output.strip()
    res = CliRunner().invoke(cli, ["sandbox", "exec", sid, "--timeout", "1.5", "--", "sleep 5"])
    assert res.exit_code == 124 and "command timed out after 1.5 s" in res.stderr


def test_kill_all_and_by_metadata(fake: FakeControlPlane) -> None:
    a = [run("sandbox", "create", "-m", "run=a").output.strip() for _ in range(3)]
    b = [run("sandbox", "create", "-m", "run=b", "-m", "x=1").output.strip() for _ in range(2)]
    res = run("sandbox", "kill", "-m", "run=a")
    assert res.exit_code == 0 and sorted(res.output.split()) == sorted(["killed"] * 3 + a)
    assert all(fake.sandboxes[i].info.state.value == "stopped" for i in a)
    assert all(fake.sandboxes[i].info.state.value == "running" for i in b)
    res = run("sandbox", "kill", "-m", "run=b", "-m", "x=2")
    assert res.exit_code == 0 and res.stdout == "" and "no live sandboxes match" in res.stderr
    c = run("sandbox", "create").output.strip()
    res = run("sandbox", "kill", "--all")
    assert res.exit_code == 0 and sorted(res.stdout.split()) == sorted(["killed"] * 3 + b + [c])
    assert all(sb.info.state.value == "stopped" for sb in fake.sandboxes.values())
    assert not fake.requests_to("DELETE", f"/v1/sandboxes/{a[0]}")[1:]  # ended ones are left alone
    res = run("sandbox", "kill", "--all")
    assert res.exit_code == 0 and "no live sandboxes" in res.stderr
    assert CliRunner().invoke(cli, ["sandbox", "kill"]).exit_code == 2
    assert CliRunner().invoke(cli, ["sandbox", "kill", c, "--all"]).exit_code == 2


def test_cost_digits_tell_small_episodes_apart() -> None:
    assert fmt_usd(0.00001625) == "0.00001625" and fmt_usd(0.0000163) == "0.00001630"
    assert fmt_usd(0.0000016) != fmt_usd(0.0000024)              # both were 0.000002
    assert fmt_usd(4.99) == "4.990000" and fmt_usd(0) == "0.000000" and fmt_usd(0.000195) == "0.0001950"


def test_since_takes_relative_times(fake: FakeControlPlane) -> None:
    _three_sandboxes(fake)
    for value in ("1h", "2d", "30m", "90s", "1w", "2h ago"):
        res = run("history", "--since", value, "--json")
        assert res.exit_code == 0, (value, res.output)
    sent = [r.url.params["since"] for r in fake.requests_to("GET", "/v1/history") if "since" in r.url.params]
    assert len(sent) == 6 and all(v.endswith("Z") for v in sent)
    bad = CliRunner().invoke(cli, ["history", "--since", "yesterday"])
    assert bad.exit_code == 2 and "30m, 1h, 2d" in bad.output


def test_listings_have_a_default_limit(fake: FakeControlPlane) -> None:
    _three_sandboxes(fake)
    assert len(json.loads(run("history", "--limit", "2", "--json").stdout)) == 2
    assert len(json.loads(run("sandbox", "list", "--all", "--limit", "2", "--json").stdout)) == 2
    assert len(json.loads(run("sandbox", "list", "--all", "--json").stdout)) == 3
    for args in (["history", "--limit", "2"], ["sandbox", "list", "--all", "--limit", "2"]):
        res = run(*args, env={"COLUMNS": "200"})
        assert "--limit N shows more" in res.stderr and res.stdout.count("sb_") == 2
    assert "shows more" not in run("sandbox", "list", "--all").stderr


def test_get_on_a_paused_sandbox_shows_timeout_left_not_end_at(fake: FakeControlPlane) -> None:
    from pilldrops.schema.api import SandboxState
    sid = run("sandbox", "create").output.strip()
    sb = fake.sandboxes[sid]
    sb.info = sb.info.model_copy(update={"state": SandboxState.paused, "timeout_left": 1234.4})
    out = run("sandbox", "get", sid, env={"COLUMNS": "200"}).output
    assert "timeout_left" in out and "1234 s (counted again from resume)" in out and "end_at" not in out
    sb.info = sb.info.model_copy(update={"state": SandboxState.running})
    out = run("sandbox", "get", sid, env={"COLUMNS": "200"}).output
    assert "end_at" in out and "timeout_left" not in out


def test_template_build_goes_through_the_control_plane_even_with_a_data_dir_in_the_environment(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """PILLDROPS_DATA_DIR exported for `up` does not make `template build` a local (root-only) build; only
    --local or --data-dir on the command line do."""
    from pilldrops.cli import local, template_remote
    calls: list[str] = []
    monkeypatch.setattr(template_remote, "build", lambda *a, **kw: calls.append("remote"))
    monkeypatch.setattr(local, "local_build", lambda *a, **kw: calls.append("local"))
    env = {"PILLDROPS_DATA_DIR": str(tmp_path), "PILLDROPS_API_KEY": "pd_x", "PILLDROPS_API_URL": "http://127.0.0.1:9"}
    assert CliRunner().invoke(cli, ["template", "build", "tiny"], env=env).exit_code == 0
    assert CliRunner().invoke(cli, ["template", "build", "tiny", "--data-dir", str(tmp_path)], env=env).exit_code == 0
    assert calls == ["remote", "local"]


def test_kill_several_ids_is_one_request_and_names_what_failed(fake: FakeControlPlane) -> None:
    ids = [run("sandbox", "create").output.strip() for _ in range(3)]
    res = CliRunner().invoke(cli, ["sandbox", "kill", *ids, "sb_nope"])
    assert res.exit_code == 1 and sorted(res.stdout.split()) == sorted(["killed"] * 3 + ids)
    assert "could not kill sb_nope: sandbox_not_found" in res.stderr
    assert len(fake.requests_to("POST", "/v1/sandboxes/kill")) == 1 and not fake.requests_to("DELETE", ".*")
    res = run("sandbox", "kill", "--label", "x=1")
    assert res.exit_code == 0 and "no live sandboxes match" in res.stderr
