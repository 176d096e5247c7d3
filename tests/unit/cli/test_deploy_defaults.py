"""Self-host defaults: `up` (one person's machine) has no credit limit unless --credits is given; `serve`
grants new teams --free-credits (5 USD); a 402 names the command that fixes it."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from pilldrops.cli import local
from pilldrops.server.service.billing import BillingSettings


def _settings(command: Any, args: list[str], monkeypatch: pytest.MonkeyPatch) -> BillingSettings:
    """The BillingSettings `command` would run with (its server start is replaced)."""
    got: list[BillingSettings] = []

    def fake_run(fn: Any, *a: Any, **backend: Any) -> None:     # run_served passes the event loop's options
        got.extend(x for x in a if isinstance(x, BillingSettings))

    import anyio
    monkeypatch.setattr(anyio, "run", fake_run)
    monkeypatch.setattr(local, "build_templates", lambda *a, **k: None)
    res = CliRunner().invoke(command, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    (settings,) = got
    return settings


def test_up_has_no_credit_limit_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    s = _settings(local.up, ["--data-dir", str(tmp_path)], monkeypatch)
    assert not s.credits_enabled
    s = _settings(local.up, ["--data-dir", str(tmp_path), "--credits", "2.5"], monkeypatch)
    assert s.credits_enabled and s.initial_credits == 2.5
    s = _settings(local.up, ["--data-dir", str(tmp_path), "--credits", "2.5", "--unlimited-credits"], monkeypatch)
    assert not s.credits_enabled


def test_serve_grants_free_credits(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    s = _settings(local.serve, ["--data-dir", str(tmp_path)], monkeypatch)
    assert s.credits_enabled and s.initial_credits == 5.0
    s = _settings(local.serve, ["--data-dir", str(tmp_path), "--free-credits", "1"], monkeypatch)
    assert s.initial_credits == 1.0
    s = _settings(local.serve, ["--data-dir", str(tmp_path), "--initial-credits", "3"], monkeypatch)  # old name
    assert s.initial_credits == 3.0
