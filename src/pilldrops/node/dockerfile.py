"""A Dockerfile as the node's ``TemplateSpec`` (the parser is the node-free ``pilldrops.dockerfile``): the
document goes through ``spec_from_dict`` like any spec, and each step keeps its Dockerfile line for messages."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from pilldrops.dockerfile import DockerfileError, ParsedDockerfile, parse_dockerfile_text
from pilldrops.dockerfile import parse_dockerfile as _parse
from pilldrops.node.templates import TemplateSpec, spec_from_dict

__all__ = ["DockerfileError", "ParsedDockerfile", "spec_of", "template_spec"]


def spec_of(parsed: ParsedDockerfile) -> TemplateSpec:
    """The node's spec of a parsed Dockerfile, copy sources relative to its context."""
    spec = spec_from_dict(parsed.document, parsed.dockerfile, context=parsed.context)
    steps = tuple(replace(s, origin=d.origin, line=d.line) for s, d in zip(spec.steps, parsed.steps, strict=True))
    return replace(spec, steps=steps)


def template_spec(dockerfile: Path, context: Path | None = None, *, name: str,
                  build_args: Mapping[str, str] | None = None, text: str | None = None) -> tuple[TemplateSpec,
                                                                                               ParsedDockerfile]:
    """Parse ``dockerfile`` (or ``text``, named by it) into the node's spec; also returns the parse."""
    parsed = (parse_dockerfile_text(text, dockerfile, context or Path(dockerfile).resolve().parent, name=name,
                                    build_args=build_args) if text is not None
              else _parse(dockerfile, context, name=name, build_args=build_args))
    return spec_of(parsed), parsed
