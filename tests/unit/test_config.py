"""Where the key comes from: explicit > PILLDROPS_API_KEY > the saved config file > E2B_API_KEY."""

from __future__ import annotations

from pathlib import Path

import pytest

from pilldrops._internal import config


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("PILLDROPS_API_KEY", "PILLDROPS_API_URL", "E2B_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))


def test_order_of_key_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config.resolve_api_key_source() == (None, "nowhere")
    monkeypatch.setenv("E2B_API_KEY", "e2b_real")
    assert config.resolve_api_key_source() == ("e2b_real", "$E2B_API_KEY")
    path = config.save_file("http://127.0.0.1:7070", "pd_saved")
    # a stale E2B key in the shell never hides the key `pilldrops up` saved
    assert config.resolve_api_key_source() == ("pd_saved", f"the config file {path}")
    monkeypatch.setenv("PILLDROPS_API_KEY", "pd_env")
    assert config.resolve_api_key_source() == ("pd_env", "$PILLDROPS_API_KEY")
    assert config.resolve_api_key_source("pd_arg") == ("pd_arg", "the explicit api_key (--api-key / api_key=)")
    assert config.resolve_api_key() == "pd_env"
