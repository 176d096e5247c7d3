"""Import direction from the architecture: the SDK never imports the server or the node; the server and
the node never import each other (they share only ``schema``); the CLI reaches server/node code only from
``cli/local.py``, inside the commands."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "pilldrops"


def imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def modules(pkg: str) -> list[Path]:
    return sorted((SRC / pkg).rglob("*.py"))


@pytest.mark.parametrize("pkg,forbidden", [
    ("sdk", ("pilldrops.server", "pilldrops.node", "pilldrops.cli")),
    ("server", ("pilldrops.node", "pilldrops.sdk", "pilldrops.cli")),
    ("node", ("pilldrops.server", "pilldrops.sdk", "pilldrops.cli")),
    ("schema", ("pilldrops.server", "pilldrops.node", "pilldrops.sdk", "pilldrops.cli")),
])
def test_forbidden_imports(pkg: str, forbidden: tuple[str, ...]) -> None:
    bad = [(p.relative_to(SRC), m) for p in modules(pkg) for m in imports(p) if m.startswith(forbidden)]
    assert not bad, bad


def test_server_layers_point_down() -> None:
    # domain and scheduler are pure: no store, service, api or HTTP
    for p in modules("server/domain") + [SRC / "server" / "scheduler.py"]:
        assert not {m for m in imports(p) if m.startswith(("pilldrops.server.store", "pilldrops.server.service",
                                                            "pilldrops.server.api", "httpx", "fastapi"))}, p
    for p in modules("server/service"):
        assert not {m for m in imports(p) if m.startswith("pilldrops.server.api")}, p
        # services are written against the store interface (Protocols), not the tables or the SQL store
        assert not {m for m in imports(p) if m.startswith(("pilldrops.server.store.models",
                                                            "pilldrops.server.store.sql", "sqlalchemy"))}, p


def test_cli_imports_server_and_node_lazily() -> None:
    for p in modules("cli"):
        top = imports(p, top_level_only=True)
        assert not {m for m in top if m.startswith(("pilldrops.server", "pilldrops.node"))}, p
