"""The Dockerfile parser and its translation into template steps (no root, no build): every instruction,
continuations, quoting, variables, errors with their line, context escapes, .dockerignore, and that a step's
cache key covers the content of what it copies."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from pilldrops.dockerfile import (
    PACKED_CONTEXT,
    PACKED_DOCKERFILE,
    DockerfileError,
    pack_context,
    parse_dockerfile,
)
from pilldrops.node import templates as node_templates
from pilldrops.node.dockerfile import spec_of
from pilldrops.node.isolation.superexec import encode_request, parse_ids
from pilldrops.node.templates import BUILD_PATH, Step, TemplateStore, spec_hash


def parse(tmp_path: Path, text: str, build_args: dict[str, str] | None = None,  # type: ignore[no-untyped-def]
          files: dict[str, str] | None = None):
    for rel, body in (files or {}).items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(body)
    (tmp_path / "Dockerfile").write_text(text)
    return parse_dockerfile(tmp_path / "Dockerfile", tmp_path, name="t", build_args=build_args or {})


def steps(parsed) -> list[tuple[str, object]]:  # type: ignore[no-untyped-def]
    return [(s.kind, s.value) for s in parsed.steps]


def error(tmp_path: Path, text: str, files: dict[str, str] | None = None) -> str:
    with pytest.raises(DockerfileError) as e:
        parse(tmp_path, text, files=files)
    return str(e.value)


def test_every_supported_instruction(tmp_path: Path) -> None:
    p = parse(tmp_path, "FROM tiny\nENV A=1\nWORKDIR /app\nCOPY a.txt .\nADD a.txt /b.txt\nARG X=2\n"
                        "RUN echo hi\nUSER nobody\n", files={"a.txt": "x"})
    assert p.base == "tiny" and p.name == "t" and p.context == tmp_path.resolve()
    assert steps(p) == [("env", {"A": "1"}), ("workdir", "/app"),
                        ("copy", {"src": "a.txt", "dest": "a.txt", "entries": [""]}),
                        ("copy", {"src": "a.txt", "dest": "/b.txt", "entries": [""]}),
                        ("run", "export X=2\necho hi"), ("user", "nobody")]
    assert [s.line for s in p.steps] == [2, 3, 4, 5, 7, 8]
    assert p.steps[0].origin == "Dockerfile:2 ENV"
    assert p.context_files == ("a.txt",)


def test_from_maps_templates_and_debian_suites(tmp_path: Path) -> None:
    assert parse(tmp_path, "FROM code-interpreter\n").base == "code-interpreter"
    assert parse(tmp_path, "from mybuilt\n").base == "mybuilt"              # keywords are case-insensitive
    for image, base in [("debian:bookworm", "base"), ("debian:bookworm-slim", "base"), ("debian:12", "base"),
                        ("docker.io/library/debian:12.5-slim", "base"), ("debian:trixie", "debian-trixie"),
                        ("debian:13-slim", "debian-trixie"), ("debian", "debian-stable"),
                        ("debian:sid", "debian-sid")]:
        spec = parse(tmp_path, f"FROM {image}\n")
        assert (spec.base, spec.workdir) == (base, "/"), image            # Docker's debian images start in /
    assert parse(tmp_path, "ARG SUITE=trixie\nFROM debian:${SUITE}\n").base == "debian-trixie"
    assert parse(tmp_path, "ARG S\nFROM debian:$S\n", {"S": "bullseye"}).base == "debian-bullseye"
    assert "FROM: ubuntu:22.04: only our templates" in error(tmp_path, "FROM ubuntu:22.04\n")
    assert "images are never pulled" in error(tmp_path, "FROM ghcr.io/x/y:1\n")
    assert "unknown Debian tag 'bookworm-20240101'" in error(tmp_path, "FROM debian:bookworm-20240101\n")
    assert "Dockerfile:2: FROM: a second FROM" in error(tmp_path, "FROM tiny\nFROM base\n")
    assert "`FROM ... AS name`" in error(tmp_path, "FROM tiny AS build\n")
    assert "option --platform=linux/amd64 is not supported" in error(tmp_path, "FROM --platform=linux/amd64 tiny\n")
    assert "cannot be built FROM itself" in error(tmp_path, "FROM t\n")
    assert "Dockerfile:1: RUN: comes before FROM" in error(tmp_path, "RUN true\nFROM tiny\n")
    assert "no FROM instruction" in error(tmp_path, "# nothing\nARG X\n")


def test_continuations_comments_and_directives(tmp_path: Path) -> None:
    text = ("# syntax=docker/dockerfile:1\n# check=skip=all\n\n# a comment\nFROM tiny\n"
            "RUN echo a \\\n    && echo b \\  \n# a comment in the middle\n\n    && echo c\n"
            "   # indented comment\nENV K=v\n")
    p = parse(tmp_path, text)
    assert steps(p) == [("run", "echo a     && echo b     && echo c"), ("env", {"K": "v"})]
    assert [s.line for s in p.steps] == [6, 12]                    # the line an instruction starts on
    # the escape directive switches the continuation (and escape) character
    p = parse(tmp_path, "# escape=`\nFROM tiny\nRUN dir c:\\ `\n  && echo ok\nENV P=c:\\x\n")
    assert steps(p) == [("run", "dir c:\\   && echo ok"), ("env", {"P": "c:\\x"})]
    assert "invalid escape directive" in error(tmp_path, "# escape=x\nFROM tiny\n")
    # a directive after the first instruction or comment is only a comment
    assert parse(tmp_path, "FROM tiny\n# escape=`\nRUN a \\\n b\n").steps[0].value == "a  b"


def test_run_shell_and_exec_forms(tmp_path: Path) -> None:
    p = parse(tmp_path, 'FROM tiny\nRUN echo "$HOME" \'$x\'\nRUN ["python3", "-c", "print(\'a b\')"]\n'
                        'RUN [ -f /x ] || true\n')
    assert steps(p) == [("run", "echo \"$HOME\" '$x'"),                    # the shell expands, not us
                        ("run", "exec python3 -c 'print('\"'\"'a b'\"'\"')'"),
                        ("run", "[ -f /x ] || true")]                      # not JSON: shell form
    assert "heredocs are not supported" in error(tmp_path, "FROM tiny\nRUN <<EOF\necho\nEOF\n")
    assert "option --mount=type=cache,target=/x is not supported" in error(
        tmp_path, "FROM tiny\nRUN --mount=type=cache,target=/x true\n")
    assert "RUN: expects a command" in error(tmp_path, "FROM tiny\nRUN\n")


def test_env_forms_quoting_and_substitution(tmp_path: Path) -> None:
    p = parse(tmp_path, 'FROM tiny\nENV A=1 B="two words" C=${A}x D=\'$A\' E=a\\ b\nENV F=$A-${B}\n'
                        'ENV LEGACY value with  spaces\nENV PATH=/opt/bin:$PATH\n'
                        'ENV G=${UNSET:-dflt} H=${A:+alt} I=${UNSET:+alt} J="${A}\\"q\\""\n')
    assert steps(p) == [
        ("env", {"A": "1", "B": "two words", "C": "x", "D": "$A", "E": "a b"}),   # same line: A not yet set
        ("env", {"F": "1-two words"}),
        ("env", {"LEGACY": "value with  spaces"}),
        ("env", {"PATH": f"/opt/bin:{BUILD_PATH}"}),                           # $PATH has Docker's default
        ("env", {"G": "dflt", "H": "alt", "I": "", "J": '1"q"'})]
    assert "unterminated double quote" in error(tmp_path, 'FROM tiny\nENV A="x\n')
    assert "invalid variable name '1A'" in error(tmp_path, "FROM tiny\nENV 1A=x\n")
    assert "bad substitution" in error(tmp_path, "FROM tiny\nENV A=${B/x/y}\n")


def test_arg_scopes_and_build_args(tmp_path: Path) -> None:
    text = ("ARG V=1\nARG ONLY_FROM=tiny\nFROM $ONLY_FROM\nARG V\nARG W=dflt X\nENV W=from-env\n"
            "RUN echo $V $W\nWORKDIR /$V/$ONLY_FROM\n")
    p = parse(tmp_path, text)
    # a global ARG re-declared after FROM keeps its default; one not re-declared is out of scope there;
    # an ENV of the same name wins over the ARG for RUN; an ARG without a value is not exported
    assert steps(p)[1:] == [("run", "export V=1\necho $V $W"), ("workdir", "/1")]
    p = parse(tmp_path, text, {"V": "9", "X": "x y", "NOPE": "1"})
    assert steps(p)[1] == ("run", "export V=9 X='x y'\necho $V $W")
    assert any("NOPE" in w for w in p.warnings)
    assert "invalid name" in error(tmp_path, "FROM tiny\nARG a-b\n")


def test_workdir_user_and_ignored_instructions(tmp_path: Path) -> None:
    p = parse(tmp_path, "FROM tiny\nWORKDIR rel/dir\nWORKDIR ../up\nENV U=app\nUSER $U:staff\nUSER 1000\n"
                        "EXPOSE 80\nCMD [\"x\"]\nENTRYPOINT x\nLABEL a=b\nVOLUME /data\nSTOPSIGNAL TERM\n")
    assert steps(p)[:2] == [("workdir", "rel/dir"), ("workdir", "../up")]     # joined by the builder
    assert steps(p)[3:] == [("user", "app:staff"), ("user", "1000")]
    assert [w.split(":")[1] for w in p.warnings] == ["7", "8", "9", "10", "11", "12"]
    assert all("is ignored" in w for w in p.warnings)
    assert "USER: expects a user name" in error(tmp_path, "FROM tiny\nUSER a b\n")


@pytest.mark.parametrize(("line", "message"), [
    ("HEALTHCHECK CMD true", "Dockerfile:2: HEALTHCHECK: not supported: sandboxes have no health checks"),
    ("ONBUILD RUN true", "Dockerfile:2: ONBUILD: not supported"),
    ("SHELL [\"bash\", \"-c\"]", "Dockerfile:2: SHELL: not supported"),
    ("FROBNICATE x", "Dockerfile:2: FROBNICATE: unknown or unsupported instruction"),
    ("COPY --from=build /a /b", "Dockerfile:2: COPY: --from (copying from another image or stage)"),
    ("COPY --link a.txt /b", "Dockerfile:2: COPY: option --link is not supported"),
    ("COPY --chmod=u+x a.txt /b", "only octal modes"),
    ("ADD https://example.invalid/f /f", "Dockerfile:2: ADD: https://example.invalid/f: URLs are not supported"),
    ("ADD --checksum=sha256:00 a.txt /f", "option --checksum is not supported"),
    ("COPY a.txt", "expects at least one source and a destination"),
    ("COPY a.txt a.txt /dir", "the destination must be a directory ending in /"),
    ("COPY missing /x", "missing: not found in the build context"),
    ("COPY *.nothing /x/", "no file of the build context matches"),
])
def test_unsupported_and_malformed_instructions(tmp_path: Path, line: str, message: str) -> None:
    assert message in error(tmp_path, f"FROM tiny\n{line}\n", {"a.txt": "x"})


def test_context_escapes_are_refused(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "real").mkdir(parents=True)
    (ctx / "real" / "f").write_text("x")
    (tmp_path / "outside").write_text("secret")
    os.symlink(tmp_path / "outside", ctx / "link")
    os.symlink(tmp_path, ctx / "dirlink")
    os.symlink("f", ctx / "real" / "inner-link")
    for src, why in [("../outside", "outside the build context"), ("real/../../outside", "outside the build context"),
                     ("link", "is a symlink"), ("dirlink/outside", "dirlink is a symlink"),
                     ("real", "real/inner-link is a symlink"), ("l*", "is a symlink")]:
        assert why in error(ctx, f"FROM tiny\nCOPY {src} /x/\n"), src
    (ctx / "real" / "inner-link").unlink()
    # an absolute source is read relative to the context (as Docker does)
    assert steps(parse(ctx, "FROM tiny\nCOPY /real/f /x\n"))[0][1]["src"] == "real/f"  # type: ignore[index]


def test_copy_sources_wildcards_dirs_and_dockerignore(tmp_path: Path) -> None:
    p = parse(tmp_path, "FROM tiny\nWORKDIR /w\nCOPY *.py conf/ /dst/\nCOPY . /all\nCOPY --chown=1:2 --chmod=640 "
                        "[\"a.py\", \"dir with space/\"]\n",
              files={"a.py": "a", "b.py": "b", "notes.txt": "n", "conf/x/ini": "i", "conf/cache/big": "b",
                     "conf/keep/me": "k", ".dockerignore": "# comment\n**/cache\n*.txt\n!notes.txt\nconf/keep\n"})
    s = steps(p)
    assert s[1] == ("copy", {"src": "a.py", "dest": "/dst/a.py", "entries": [""]})
    assert s[2] == ("copy", {"src": "b.py", "dest": "/dst/b.py", "entries": [""]})
    assert s[3] == ("copy", {"src": "conf", "dest": "/dst", "entries": ["x/", "x/ini"]})   # cache, keep ignored
    all_entries = s[4][1]["entries"]  # type: ignore[index]
    assert "notes.txt" in all_entries and "conf/keep/" not in all_entries and "conf/cache/" not in all_entries
    assert s[5][1] == {"src": "a.py", "dest": "dir with space/a.py", "entries": [""],  # type: ignore[index]
                       "chown": "1:2", "chmod": "640"}
    assert "a.py" in p.context_files and "conf/cache/big" not in p.context_files
    assert "excluded by .dockerignore" in error(tmp_path, "FROM tiny\nCOPY conf/cache /x\n")


def test_add_of_a_local_archive_is_unpacked(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.addfile(tarfile.TarInfo("x"), io.BytesIO(b""))
    (tmp_path / "a.tgz").write_bytes(buf.getvalue())
    p = parse(tmp_path, "FROM tiny\nADD a.tgz /opt/\nCOPY a.tgz /opt/\n")
    assert steps(p)[0] == ("copy", {"src": "a.tgz", "dest": "/opt", "entries": [""], "extract": True})
    assert steps(p)[1] == ("copy", {"src": "a.tgz", "dest": "/opt/a.tgz", "entries": [""]})   # COPY never unpacks


def test_the_cache_key_covers_copied_content_args_and_not_line_numbers(tmp_path: Path) -> None:
    def key(text: str, args: dict[str, str] | None = None) -> str:
        return spec_hash(spec_of(parse(tmp_path, text, args)), "parent")
    base = "FROM tiny\nARG V=1\nCOPY app /app\nRUN echo $V\n"
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "f").write_text("one")
    (tmp_path / "app" / "ignored.log").write_text("x")
    (tmp_path / ".dockerignore").write_text("app/*.log\n")
    k = key(base)
    assert key(base) == k
    assert key("# a new comment\n\n" + base) == k                         # moving lines rebuilds nothing
    (tmp_path / "app" / "ignored.log").write_text("y")
    assert key(base) == k                                                 # an ignored file is not an input
    (tmp_path / "app" / "f").write_text("two")
    assert key(base) != k                                                 # a copied file's content is
    k2 = key(base)
    (tmp_path / "app" / "new").write_text("")
    assert key(base) != k2                                                # and so is a new file
    assert key(base, {"V": "2"}) != key(base)                             # and a build arg RUN sees


def test_pack_context_holds_exactly_what_the_build_reads(tmp_path: Path) -> None:
    p = parse(tmp_path, "FROM tiny\nCOPY src /src\n",
              files={"src/a": "a", "src/sub/b": "b", "unrelated": "u", ".dockerignore": "src/sub/b\n"})
    buf = io.BytesIO()
    pack_context(p, buf)
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        names = sorted(tar.getnames())
        unpacked = tmp_path / "unpacked"
        tar.extractall(unpacked, filter="data")
    assert names == sorted([PACKED_DOCKERFILE, PACKED_CONTEXT, *(f"{PACKED_CONTEXT}/{n}" for n in (".dockerignore", "src", "src/a",
                                                                                   "src/sub"))])
    again = parse_dockerfile(unpacked / PACKED_DOCKERFILE, unpacked / PACKED_CONTEXT, name="t")
    assert [s.value for s in again.steps] == [s.value for s in p.steps]
    assert spec_hash(spec_of(again), "p") == spec_hash(spec_of(p), "p")            # same key on the builder node


def test_recorded_spec_round_trips_with_its_hash(tmp_path: Path) -> None:
    """build_spec records a Dockerfile's spec; the store lists it with its hash even after the context is gone."""
    from pilldrops.node.templates import spec_from_json, spec_to_json
    p = parse(tmp_path, "FROM tiny\nCOPY f /f\nUSER nobody\n", files={"f": "x"})
    h = spec_hash(spec_of(p), "parent")
    d = tmp_path / "data" / "templates" / "t"
    d.mkdir(parents=True)
    (d / "spec.json").write_text(__import__("json").dumps(spec_to_json(spec_of(p), h)))
    (tmp_path / "f").unlink()
    store = TemplateStore(tmp_path / "data", spec_dirs=[])
    rec = store.spec("t")
    assert rec == spec_from_json(spec_to_json(spec_of(p), h)) and store.hash("t") == h
    assert [(s.kind, s.value, s.line) for s in rec.steps] == [(s.kind, s.value, s.line) for s in p.steps]
    assert [t.name for t in store.list()] == ["t"]
    assert store.spec("debian-trixie").base == "debootstrap:trixie"       # FROM debian:trixie's parent
    assert isinstance(rec.steps[0], Step)
    # the parser's own copies of the node's constants agree with them
    from pilldrops import dockerfile
    assert (dockerfile.BUILD_PATH, dockerfile.DEFAULT_SUITE) == (node_templates.BUILD_PATH,
                                                                 node_templates.DEFAULT_SUITE)


def test_user_ids_reach_pd_init_in_the_request() -> None:
    plain = encode_request(["id"], {}, "/", stdin=False, hello=False)
    as_user = encode_request(["id"], {}, "/", stdin=False, hello=False, user="1234:99")
    assert plain[5] == 0 and as_user[5] == 4                               # flag 4: user follows
    assert as_user[14:22] == (1234).to_bytes(4, "little") + (99).to_bytes(4, "little")
    assert parse_ids("0:0") == (0, 0)
    for bad in ("app", "1:", "-1:2", "1:2:3", f"{2**32}:0"):
        with pytest.raises(ValueError):
            parse_ids(bad)


def test_document_round_trips_and_a_remote_document_is_checked(tmp_path: Path) -> None:
    """The document (what a remote build sends) gives back the same spec; one crafted to leave its context
    or use an unknown step is refused by spec_from_dict before anything runs."""
    from pilldrops.dockerfile import to_document
    from pilldrops.node.templates import TemplateSpecError, spec_from_dict
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "f").write_text("x")
    text = "FROM tiny\nWORKDIR w\nCOPY --chown=1:1 app ./\nUSER 1:1\nRUN echo hi\n"
    doc = to_document(text, "t", context=tmp_path)
    spec = spec_from_dict(doc, tmp_path / "Dockerfile", context=tmp_path)
    assert [(s.kind, s.value) for s in spec.steps] == steps(parse(tmp_path, text))
    assert spec_hash(spec, "p") == spec_hash(spec_of(parse(tmp_path, text)), "p")
    with pytest.raises(ValueError, match="Dockerfile:2: HEALTHCHECK"):
        to_document("FROM tiny\nHEALTHCHECK NONE\n", "t", context=tmp_path)
    for bad_step, why in [({"copy": {"src": "app", "dest": "/x", "entries": ["../../etc/passwd"]}}, "inside src"),
                          ({"copy": {"src": "../app", "dest": "/x", "entries": ["f"]}}, "inside src"),
                          ({"copy": {"src": "app", "dest": "/x", "mode": "1"}}, "'copy' must be"),
                          ({"copy": {"src": "app", "dest": "/x", "chmod": "u+x"}}, "octal"),
                          ({"user": "root; rm -rf /"}, "'user' must be"),
                          ({"shell": "bash"}, "unknown step kind")]:
        with pytest.raises(TemplateSpecError, match=why):
            spec_from_dict({**doc, "steps": [bad_step]}, tmp_path / "Dockerfile", context=tmp_path)
