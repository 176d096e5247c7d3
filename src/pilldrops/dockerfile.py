"""Dockerfile templates, for the CLI and the remote-build path: a Dockerfile as a template spec document.

The parser is ``pilldrops.node.dockerfile`` (imported when called: this module stays free of node code at
import time); see docs/templates.md for the supported subset.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def to_document(text: str, name: str, *, context: str | Path = ".", build_args: Mapping[str, str] | None = None,
                dockerfile: str | Path = "Dockerfile") -> dict[str, Any]:
    """The template spec document (a TOML spec's shape) of Dockerfile ``text``, whose COPY/ADD read from
    ``context``. A Dockerfile outside the subset raises ``ValueError`` naming the instruction and its line."""
    from pilldrops.node.dockerfile import parse_dockerfile_text
    return parse_dockerfile_text(text, Path(dockerfile), Path(context), name=name, build_args=build_args).document
