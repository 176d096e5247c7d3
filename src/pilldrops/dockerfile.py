"""Dockerfile templates: the common subset of a Dockerfile, translated into a template spec document (the
shape of a TOML spec, ``node/templates.spec_document``) with the same steps the TOML specs use, so caching,
layer hashing and the build log behave the same. Pure code (no node or server imports): the CLI, the SDK
(which sends the document and its context to a control plane) and the node's builder all use it. No Docker
engine and no image pull: ``FROM`` names one of our templates (or a Debian suite, which becomes a
debootstrap-built base).

Supported: ``FROM`` (one, no ``AS``), ``RUN`` (shell and exec form), ``COPY``/``ADD`` from the context
(``--chown``/``--chmod``; a local tar archive given to ``ADD`` is unpacked), ``ENV``, ``WORKDIR``, ``ARG``
(``--build-arg``), ``USER``; comments, line continuations and parser directives (``# syntax`` is ignored,
``# escape`` is honoured). ``CMD``/``ENTRYPOINT``/``EXPOSE``/``LABEL``/``MAINTAINER``/``STOPSIGNAL``/``VOLUME``
are accepted and ignored with a warning (a sandbox has no main process: pd-init is PID 1 and commands are
exec'd; ports are reachable without ``EXPOSE``). Anything else is a :class:`DockerfileError` naming the
instruction and its line. Copied paths stay inside the context: ``..``, absolute sources and symlinks are
refused; ``.dockerignore`` is honoured.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any

from pilldrops._internal.dockerignore import PACKED_CONTEXT, PACKED_DOCKERFILE, ignore_rules, ignored

BUILD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"   # = node/templates.BUILD_PATH
DEFAULT_SUITE = "bookworm"                                                   # = node/templates.DEFAULT_SUITE

IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "VOLUME"}
UNSUPPORTED = {
    "HEALTHCHECK": "sandboxes have no health checks",
    "ONBUILD": "templates have no build triggers",
    "SHELL": "RUN always uses /bin/sh -c (write `RUN [\"bash\", \"-c\", \"...\"]` for another shell)",
}
# Debian suites a FROM may name (numbers are the releases' versions); "stable"/"latest" is the mirror's stable
DEBIAN_SUITES = {"buster": "buster", "10": "buster", "bullseye": "bullseye", "11": "bullseye",
                 "bookworm": "bookworm", "12": "bookworm", "trixie": "trixie", "13": "trixie",
                 "forky": "forky", "14": "forky", "sid": "sid", "unstable": "sid", "testing": "testing",
                 "stable": "stable", "latest": "stable", "oldstable": "oldstable"}
_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z][a-zA-Z0-9]*)\s*=\s*(.*?)\s*$")
_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*(:[A-Za-z0-9_.][A-Za-z0-9_.-]*)?")
_ARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_DOCKERFILE_BYTES = 1024 * 1024


class DockerfileError(ValueError):
    """A Dockerfile uses something outside the supported subset, or is malformed. ``str()`` names the file,
    the line and the instruction."""

    def __init__(self, path: Path | str, line: int, instruction: str, message: str) -> None:
        self.line, self.instruction = line, instruction
        where = f"{Path(path).name}:{line}" if line else str(Path(path).name)
        super().__init__(f"{where}: {instruction + ': ' if instruction else ''}{message}")


@dataclass(frozen=True)
class Step:
    kind: str                     # run | copy | env | workdir | user
    value: Any
    origin: str = ""              # "Dockerfile:12 RUN", for messages
    line: int = 0


@dataclass(frozen=True)
class ParsedDockerfile:
    name: str
    description: str
    base: str                          # a template name, or debian-<suite> (bookworm: our `base`)
    workdir: str | None                # "/" for a Debian base, else None (the parent's)
    steps: tuple[Step, ...]
    context: Path
    context_files: tuple[str, ...]     # relative POSIX paths under the context that the build reads
    warnings: tuple[str, ...] = ()
    dockerfile: Path = field(default=Path("Dockerfile"))

    @property
    def document(self) -> dict[str, Any]:
        """The template spec document (``node/templates.spec_document``'s shape): what a build takes."""
        return {"name": self.name, "description": self.description, "from": self.base, "env": {},
                "workdir": self.workdir, "isolation": None, "steps": [{s.kind: s.value} for s in self.steps]}

    @property
    def context_dirs(self) -> tuple[str, ...]:
        """The folders (context-relative) the COPY steps create, for packing a context."""
        copies = [s.value for s in self.steps if s.kind == "copy"]
        dirs = {os.path.normpath(os.path.join(v["src"], e)) for v in copies for e in v["entries"] if e.endswith("/")}
        dirs |= {os.path.normpath(v["src"]) for v in copies if v["entries"] != [""]}    # a copied folder itself
        return tuple(sorted(dirs - {"."}))


@dataclass(frozen=True)
class _Instr:
    line: int
    keyword: str        # upper case
    args: str           # the rest, continuations joined


# -- lexing ----------------------------------------------------------------------------------------------
def _instructions(text: str, path: Path) -> tuple[list[_Instr], str]:
    """Split into instructions (continuations joined, comments dropped). Returns them and the escape char."""
    lines = text.splitlines()
    escape = "\\"
    i = 0
    while i < len(lines):                           # parser directives: only at the very top
        m = _DIRECTIVE.match(lines[i])
        if not m:
            break
        key, value = m.group(1).lower(), m.group(2)
        if key == "escape":
            if value not in ("\\", "`"):
                raise DockerfileError(path, i + 1, "", f"invalid escape directive {value!r} (use \\ or `)")
            escape = value
        i += 1
    cont = re.compile(re.escape(escape) + r"[ \t]*$")
    out: list[_Instr] = []
    while i < len(lines):
        raw = lines[i]
        start = i
        i += 1
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        parts = []
        line = raw.lstrip()
        while cont.search(line):
            parts.append(cont.sub("", line))
            # the next non-comment, non-empty line continues this instruction
            while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                i += 1
            if i >= len(lines):
                line = ""
                break
            line = lines[i]
            i += 1
        parts.append(line)
        joined = "".join(parts).strip()
        m = re.match(r"^(\S+)\s*(.*)$", joined, re.DOTALL)
        assert m is not None
        keyword, args = m.group(1), m.group(2)
        out.append(_Instr(start + 1, keyword.upper(), args.strip()))
    return out, escape


def _exec_form(args: str) -> list[str] | None:
    """A JSON array of strings (``["a", "b"]``), or None for the shell form."""
    if not args.startswith("["):
        return None
    try:
        v = json.loads(args)
    except ValueError:
        return None
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return v
    return None


class _Words:
    """Docker's word processing: quotes, the escape char and ``$VAR``/``${VAR}``/``${VAR:-x}``/``${VAR:+x}``."""

    def __init__(self, env: Mapping[str, str], escape: str, fail: Any) -> None:
        self.env, self.escape, self.fail = env, escape, fail

    def split(self, s: str, *, expand: bool = True) -> list[str]:
        words: list[str] = []
        cur: list[str] = []
        have = False
        i, n = 0, len(s)
        while i < n:
            c = s[i]
            if c in " \t\r\n":
                if have:
                    words.append("".join(cur))
                    cur, have = [], False
                i += 1
                continue
            have = True
            if c == self.escape and i + 1 < n:
                cur.append(s[i + 1])
                i += 2
            elif c == "'":
                j = s.find("'", i + 1)
                if j < 0:
                    self.fail("unterminated single quote")
                cur.append(s[i + 1:j])
                i = j + 1
            elif c == '"':
                i += 1
                while True:
                    if i >= n:
                        self.fail("unterminated double quote")
                    c = s[i]
                    if c == '"':
                        i += 1
                        break
                    if c == self.escape and i + 1 < n and s[i + 1] in ('"', "$", self.escape):
                        cur.append(s[i + 1])
                        i += 2
                    elif c == "$" and expand:
                        val, i = self._var(s, i)
                        cur.append(val)
                    else:
                        cur.append(c)
                        i += 1
            elif c == "$" and expand:
                val, i = self._var(s, i)
                cur.append(val)
            else:
                cur.append(c)
                i += 1
        if have:
            words.append("".join(cur))
        return words

    def word(self, s: str) -> str:
        """One word: quotes and variables processed, inner whitespace kept (WORKDIR, USER, ENV legacy)."""
        return " ".join(self.split(s.replace(" ", "\0").replace("\t", "\1"))).replace("\0", " ").replace("\1", "\t")

    def _var(self, s: str, i: int) -> tuple[str, int]:
        n = len(s)
        if i + 1 < n and s[i + 1] == "{":
            j = s.find("}", i + 2)
            if j < 0:
                self.fail("missing '}' in variable substitution")
            body = s[i + 2:j]
            m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-+])(.*))?$", body, re.DOTALL)
            if not m:
                self.fail(f"bad substitution ${{{body}}} (supported: ${{VAR}}, ${{VAR:-default}}, ${{VAR:+alt}})")
            name, colon, op, word = m.group(1), m.group(2), m.group(3), m.group(4) or ""
            val = self.env.get(name)
            missing = val is None or (colon == ":" and val == "")
            if op == "-":
                return (self.word(word) if missing else val or ""), j + 1
            if op == "+":
                return ("" if missing else self.word(word)), j + 1
            return val or "", j + 1
        m = re.match(r"[A-Za-z_][A-Za-z0-9_]*", s[i + 1:])
        if not m:
            return "$", i + 1
        return self.env.get(m.group(0), ""), i + 1 + len(m.group(0))


# -- the translation ---------------------------------------------------------------------------------------
class _Translator:
    def __init__(self, path: Path, context: Path, name: str, build_args: Mapping[str, str]) -> None:
        self.path, self.context, self.name = path, context, name
        self.build_args = dict(build_args)
        self.used_args: set[str] = set()
        self.global_args: dict[str, str | None] = {}
        self.args: dict[str, str] = {}          # ARGs in scope after FROM
        self.env: dict[str, str] = {}            # ENV set by this Dockerfile
        self.steps: list[Step] = []
        self.files: set[str] = set()
        self.warnings: list[str] = []
        self.rules = ignore_rules(context)
        self.base: str | None = None
        self.initial_workdir: str | None = None  # "/" for a Debian base (Docker's images start there)
        self.base_label = ""
        self.escape = "\\"
        self.instr: _Instr | None = None

    def fail(self, msg: str) -> Any:
        i = self.instr
        raise DockerfileError(self.path, i.line if i else 0, i.keyword if i else "", msg)

    def words(self, env: Mapping[str, str] | None = None) -> _Words:
        return _Words(self.scope() if env is None else env, self.escape, self.fail)

    def scope(self) -> dict[str, str]:
        """What ``$VAR`` means here: PATH's default, ARGs in scope, then ENV (ENV wins, as in Docker)."""
        if self.base is None:
            return {k: v for k, v in self.global_args.items() if v is not None}
        return {"PATH": BUILD_PATH, **self.args, **self.env}

    def run(self, text: str, instructions: list[_Instr]) -> ParsedDockerfile:
        for ins in instructions:
            self.instr = ins
            if ins.keyword in UNSUPPORTED:
                self.fail(f"not supported: {UNSUPPORTED[ins.keyword]}")
            handler = getattr(self, f"do_{ins.keyword.lower()}", None) if re.fullmatch(r"[A-Z]+", ins.keyword) \
                else None
            if handler is None and ins.keyword not in IGNORED:
                self.fail("unknown or unsupported instruction (supported: FROM, RUN, COPY, ADD, ENV, "
                          "WORKDIR, ARG, USER; ignored: " + ", ".join(sorted(IGNORED)) + ")")
            if self.base is None and ins.keyword not in ("FROM", "ARG"):
                self.fail("comes before FROM (only ARG may)")
            if handler is None:
                self.warnings.append(f"{self.path.name}:{ins.line}: {ins.keyword} is ignored (a sandbox has no "
                                     "main process or image metadata: run commands with sandbox.run)")
                continue
            handler(ins.args)
        self.instr = None
        if self.base is None:
            raise DockerfileError(self.path, 0, "", "no FROM instruction")
        unused = sorted(set(self.build_args) - self.used_args)
        if unused:
            self.warnings.append(f"build args not declared by an ARG (so unused): {', '.join(unused)}")
        return ParsedDockerfile(name=self.name, description=f"from {self.path.name} ({self.base_label})",
                                base=self.base, workdir=self.initial_workdir, steps=tuple(self.steps),
                                context=self.context, context_files=tuple(sorted(self.files)),
                                warnings=tuple(self.warnings), dockerfile=self.path)

    # FROM --------------------------------------------------------------------------------------------
    def do_from(self, args: str) -> None:
        if self.base is not None:
            self.fail("a second FROM: multi-stage builds are not supported (one FROM per Dockerfile)")
        words = self.words().split(args)
        if any(w.startswith("--") for w in words):
            self.fail(f"option {next(w for w in words if w.startswith('--'))} is not supported")
        if len(words) == 3 and words[1].lower() == "as":
            self.fail("`FROM ... AS name` (multi-stage builds) is not supported")
        if len(words) != 1:
            self.fail("expects one base: a template name or debian:<suite>")
        image = words[0]
        self.base_label = image
        ref = image.removeprefix("docker.io/").removeprefix("library/")
        repo, _, tag = ref.partition(":")
        if "@" in ref:
            self.fail(f"{image}: digests name registry images; images are never pulled")
        if repo == "debian":
            tag = tag or "latest"
            suite = DEBIAN_SUITES.get(tag.removesuffix("-slim").split(".")[0])
            if suite is None:
                self.fail(f"{image}: unknown Debian tag {tag!r} (use a suite or release: "
                          f"{', '.join(k for k in DEBIAN_SUITES if not k.isdigit())}, or 10-14, optionally -slim)")
            # bookworm is our `base` template's debootstrap minbase, already built on most machines
            self.base = "base" if suite == DEFAULT_SUITE else f"debian-{suite}"
            self.initial_workdir = "/"          # Docker's debian images start in /
        elif ":" in ref or "/" in repo or "." in repo:
            self.fail(f"{image}: only our templates (tiny, base, code-interpreter or one you built) or "
                      "debian:<suite> can be a base; images are never pulled")
        else:
            if repo == self.name:
                self.fail(f"template {self.name!r} cannot be built FROM itself")
            self.base = repo
        self.args = {}

    # ARG ---------------------------------------------------------------------------------------------
    def do_arg(self, args: str) -> None:
        for w in self.words(self.scope()).split(args):
            name, eq, default = w.partition("=")
            if not _ARG_NAME.match(name):
                self.fail(f"invalid name {name!r}")
            value: str | None = default if eq else None
            if name in self.build_args:
                value = self.build_args[name]
                self.used_args.add(name)
            if self.base is None:
                self.global_args[name] = value
            else:
                if value is None and name in self.global_args:
                    value = self.global_args[name]
                if value is not None:
                    self.args[name] = value

    # ENV ---------------------------------------------------------------------------------------------
    def do_env(self, args: str) -> None:
        pairs = self._pairs(args)
        if not pairs:
            self.fail("expects KEY=VALUE")
        self.env.update(pairs)
        self.steps.append(self._step("env", dict(pairs)))

    def _pairs(self, args: str) -> dict[str, str]:
        raw = self.words().split(args, expand=False)
        if raw and "=" not in raw[0]:               # legacy `ENV KEY value with spaces`
            key, _, rest = args.partition(" ") if " " in args else args.partition("\t")
            if not rest.strip():
                self.fail(f"{key} has no value")
            return {self._key(key.strip()): self.words().word(rest.strip())}
        out: dict[str, str] = {}
        words = self.words().split(args)            # expansion uses what was set before this line
        for w in words:
            k, eq, v = w.partition("=")
            if not eq:
                self.fail(f"{w!r} is not KEY=VALUE")
            out[self._key(k)] = v
        return out

    def _key(self, k: str) -> str:
        if not _ARG_NAME.match(k):
            self.fail(f"invalid variable name {k!r}")
        return k

    # WORKDIR / USER ------------------------------------------------------------------------------------
    def do_workdir(self, args: str) -> None:
        w = self.words().word(args)
        if not w:
            self.fail("expects a path")
        # a relative WORKDIR (and COPY destination) is relative to the workdir in effect at that point,
        # which may be the parent template's: the store joins them when it runs the step
        self.steps.append(self._step("workdir", os.path.normpath(w)))

    def do_user(self, args: str) -> None:
        u = self.words().word(args)
        if not u or not _USER.fullmatch(u):
            self.fail(f"expects a user name or uid, optionally :group or :gid (got {u!r})")
        self.steps.append(self._step("user", u))

    # RUN ---------------------------------------------------------------------------------------------
    def do_run(self, args: str) -> None:
        if args.startswith("--"):
            self.fail(f"option {args.split()[0]} is not supported")
        if args.startswith("<<"):
            self.fail("heredocs are not supported (write the script to a file and COPY it)")
        argv = _exec_form(args)
        if argv is not None:
            if not argv:
                self.fail("empty exec form")
            script = "exec " + " ".join(shlex.quote(a) for a in argv)
        else:
            if not args:
                self.fail("expects a command")
            script = args
        # ARG values reach RUN as environment variables (not kept in the template), ENV of the same name wins
        exported = {k: v for k, v in self.args.items() if k not in self.env}
        if exported:
            script = "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(exported.items())) + "\n" \
                + script
        self.steps.append(self._step("run", script))

    # COPY / ADD --------------------------------------------------------------------------------------
    def do_copy(self, args: str) -> None:
        self._copy(args, add=False)

    def do_add(self, args: str) -> None:
        self._copy(args, add=True)

    def _copy(self, args: str, *, add: bool) -> None:
        if args.startswith("<<"):
            self.fail("heredocs are not supported")
        opts: dict[str, str] = {}
        rest = args
        while m := re.match(r"--([A-Za-z-]+)(?:=(\S*))?\s*", rest):
            flag, value = m.group(1), self.words().word(m.group(2) or "")
            rest = rest[m.end():]
            if flag == "from":
                self.fail("--from (copying from another image or stage) is not supported: copy from the context")
            if flag not in ("chown", "chmod"):
                self.fail(f"option --{flag} is not supported (supported: --chown, --chmod)")
            if not value:
                self.fail(f"--{flag} needs a value")
            if flag == "chmod" and not re.fullmatch(r"[0-7]{3,4}", value):
                self.fail(f"--chmod={value}: only octal modes are supported")
            if flag == "chown" and not _USER.fullmatch(value):
                self.fail(f"--chown={value}: expects user[:group] (names or ids)")
            opts[flag] = value
        exec_form = _exec_form(rest)
        words = [self.words().word(w) for w in exec_form] if exec_form is not None else self.words().split(rest)
        if len(words) < 2:
            self.fail("expects at least one source and a destination")
        *sources, dest = words
        if len(sources) > 1 and not dest.endswith("/"):
            self.fail(f"with several sources the destination must be a directory ending in / (got {dest!r})")
        to_dir = dest.endswith(("/", "/.")) or dest in (".", "..")
        dest = os.path.normpath(dest)
        matched: list[str] = []
        for src in sources:
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", src):
                self.fail(f"{src}: URLs are not supported (only files and folders of the build context)"
                          if add else f"{src}: COPY takes files of the build context, not URLs")
            matched += self._sources(src)
        for rel in matched:
            full = self.context / rel if rel != "." else self.context
            entries = self._entries(rel, full)
            if add and full.is_file() and tarfile.is_tarfile(full):
                value: dict[str, Any] = {"src": rel, "dest": dest, "entries": entries, "extract": True}
            elif full.is_dir():
                value = {"src": rel, "dest": dest, "entries": entries}
            else:
                target = os.path.normpath(os.path.join(dest, PurePosixPath(rel).name)) if (to_dir or len(matched) > 1) \
                    else dest
                value = {"src": rel, "dest": target, "entries": entries}
            value.update(opts)
            self.steps.append(self._step("copy", value))

    def _sources(self, src: str) -> list[str]:
        """Context-relative sources a COPY names (wildcards expanded); escapes of the context refused."""
        if src.startswith("/"):
            src = src.lstrip("/")             # Docker reads absolute sources relative to the context
        norm = os.path.normpath(src) if src else "."
        if norm == ".." or norm.startswith("../"):
            self.fail(f"{src}: outside the build context")
        if any(ch in norm for ch in "*?["):
            # a wildcard never crosses a /: compare paths with as many components as the pattern
            found = [rel for rel in self._walk(".") if rel.count("/") == norm.count("/")
                     and fnmatch.fnmatchcase(rel, norm)]
            if not found:
                self.fail(f"{src}: no file of the build context matches")
            for rel in found:
                self._check_inside(rel)
            return sorted(found)
        self._check_inside(norm)
        full = self.context / norm if norm != "." else self.context
        if not full.exists():
            self.fail(f"{src}: not found in the build context ({self.context})")
        if norm != "." and ignored(norm, self.rules):
            self.fail(f"{src}: excluded by .dockerignore")
        return [norm]

    def _check_inside(self, rel: str) -> None:
        cur = self.context
        for part in PurePosixPath(rel).parts if rel != "." else ():
            cur = cur / part
            if cur.is_symlink():
                self.fail(f"{rel}: {cur.relative_to(self.context)} is a symlink (refused: copied paths must "
                          "stay inside the build context)")

    def _walk(self, rel: str) -> list[str]:
        """Every path under ``rel`` (context-relative, dirs included), .dockerignore applied."""
        out = []
        base = self.context / rel if rel != "." else self.context
        for root, dirs, files in os.walk(base):
            dirs.sort()
            for n in sorted(dirs) + sorted(files):
                p = Path(root) / n
                r = p.relative_to(self.context).as_posix()
                if ignored(r, self.rules):
                    continue
                out.append(r)
        return out

    def _entries(self, rel: str, full: Path) -> list[str]:
        """What a copy of ``rel`` writes, relative to it (dirs end in /): the files it reads are recorded
        for the context tarball. Symlinks anywhere and special files are refused."""
        if full.is_symlink():
            self.fail(f"{rel} is a symlink (refused: copied paths must stay inside the build context)")
        if full.is_file():
            self.files.add(rel)
            return [""]
        entries = []
        for r in self._walk(rel):
            p = self.context / r
            sub = r[len(rel) + 1:] if rel != "." else r
            if p.is_symlink():
                self.fail(f"{r} is a symlink (refused: copied paths must stay inside the build context)")
            if p.is_dir():
                entries.append(sub + "/")
            elif p.is_file():
                entries.append(sub)
                self.files.add(r)
            else:
                self.fail(f"{r} is not a regular file or folder")
        return entries

    def _step(self, kind: str, value: Any) -> Step:
        assert self.instr is not None
        return Step(kind, value, origin=f"{self.path.name}:{self.instr.line} {self.instr.keyword}",
                    line=self.instr.line)


def parse_dockerfile(dockerfile: Path, context: Path | None = None, *, name: str,
                     build_args: Mapping[str, str] | None = None) -> ParsedDockerfile:
    """Translate ``dockerfile`` (its build context: ``context``, default its folder) into a template spec."""
    path = Path(dockerfile)
    try:
        if path.stat().st_size > MAX_DOCKERFILE_BYTES:
            raise DockerfileError(path, 0, "", f"larger than {MAX_DOCKERFILE_BYTES} bytes")
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DockerfileError(path, 0, "", f"cannot read: {e}") from e
    return parse_dockerfile_text(text, path, context if context is not None else path.resolve().parent,
                                 name=name, build_args=build_args)


def parse_dockerfile_text(text: str, dockerfile: Path, context: Path, *, name: str,
                          build_args: Mapping[str, str] | None = None) -> ParsedDockerfile:
    """:func:`parse_dockerfile` of ``text`` (``dockerfile`` only names it in messages and in the spec)."""
    path, ctx = Path(dockerfile), Path(context)
    if not ctx.is_dir():
        raise DockerfileError(path, 0, "", f"build context {ctx} is not a folder")
    if len(text) > MAX_DOCKERFILE_BYTES:
        raise DockerfileError(path, 0, "", f"larger than {MAX_DOCKERFILE_BYTES} bytes")
    instructions, escape = _instructions(text, path)
    t = _Translator(path.resolve(), ctx.resolve(), name, build_args or {})
    t.escape = escape
    return t.run(text, instructions)


def pack_context(parsed: ParsedDockerfile, fileobj: IO[bytes]) -> None:
    """A gzip'd tar of the Dockerfile (at ``PACKED_DOCKERFILE``) and the context files the build reads (under
    ``PACKED_CONTEXT/``): unpacked elsewhere, ``parse_dockerfile(tmp / PACKED_DOCKERFILE, tmp / PACKED_CONTEXT)``
    gives the same steps and the same cache key."""
    with tarfile.open(fileobj=fileobj, mode="w:gz") as tar:
        tar.add(parsed.dockerfile, arcname=PACKED_DOCKERFILE, recursive=False)
        info = tarfile.TarInfo(PACKED_CONTEXT)
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
        ctx = parsed.context
        if (ctx / ".dockerignore").is_file() and not (ctx / ".dockerignore").is_symlink():
            tar.add(ctx / ".dockerignore", arcname=f"{PACKED_CONTEXT}/.dockerignore", recursive=False)
        for d in parsed.context_dirs:
            tar.add(ctx / d, arcname=f"{PACKED_CONTEXT}/{d}", recursive=False)
        for rel in parsed.context_files:
            tar.add(ctx / rel, arcname=f"{PACKED_CONTEXT}/{rel}", recursive=False)


def to_document(text: str, name: str, *, context: str | Path = ".", build_args: Mapping[str, str] | None = None,
                dockerfile: str | Path = "Dockerfile") -> dict[str, Any]:
    """The template spec document of Dockerfile ``text`` whose COPY/ADD read from ``context``. A Dockerfile
    outside the subset raises :class:`DockerfileError` (a ``ValueError``) naming the instruction and line."""
    return parse_dockerfile_text(text, Path(dockerfile), Path(context), name=name, build_args=build_args).document
