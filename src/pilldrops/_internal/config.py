"""Where the SDK and the CLI find the API URL and key, and where `pilldrops up` saves them.

Order for the URL: explicit argument > ``PILLDROPS_API_URL`` > the user's config file > default.
Order for the key: explicit argument > ``PILLDROPS_API_KEY`` > the config file (the key ``pilldrops up``
saved) > ``E2B_API_KEY`` (stock E2B users). A stale E2B key in the shell never hides the saved one, and
:func:`resolve_api_key_source` tells where the key came from so an auth error can name it.
The config file is ``$XDG_CONFIG_HOME/pilldrops/config.json`` (default ``~/.config/pilldrops/config.json``),
mode 0600, holding ``{"api_url": ..., "api_key": ...}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DEFAULT_API_URL = "http://127.0.0.1:7070"


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "pilldrops"


def config_path() -> Path:
    return config_dir() / "config.json"


def load_file() -> dict[str, str]:
    try:
        data = json.loads(config_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}


def save_file(api_url: str, api_key: str) -> Path:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"api_url": api_url, "api_key": api_key}, f, indent=2)
    os.replace(tmp, path)
    return path


def resolve_api_url(explicit: str | None = None) -> str:
    return (explicit or os.environ.get("PILLDROPS_API_URL") or load_file().get("api_url")
            or DEFAULT_API_URL).rstrip("/")


def resolve_api_key_source(explicit: str | None = None) -> tuple[str | None, str]:
    """``(key, where it came from)``; the key is ``None`` when none is found anywhere."""
    if explicit:
        return explicit, "the explicit api_key (--api-key / api_key=)"
    if os.environ.get("PILLDROPS_API_KEY"):
        return os.environ["PILLDROPS_API_KEY"], "$PILLDROPS_API_KEY"
    saved = load_file().get("api_key")
    if saved:
        return saved, f"the config file {config_path()}"
    if os.environ.get("E2B_API_KEY"):
        return os.environ["E2B_API_KEY"], "$E2B_API_KEY"
    return None, "nowhere"


def resolve_api_key(explicit: str | None = None) -> str | None:
    return resolve_api_key_source(explicit)[0]
