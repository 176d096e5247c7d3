"""Template specs: parsing, validation, hashing (parent chain, copied files), env/workdir resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from pilldrops.errors import TemplateNotFound
from pilldrops.node import templates as T


def write(d: Path, name: str, body: str) -> Path:
    p = d / f"{name}.toml"
    p.write_text(body)
    return p


def test_packaged_specs_parse() -> None:
    store = T.TemplateStore(Path("/nonexistent-data"))
    specs = store.specs()
    assert {"tiny", "base", "code-interpreter"} <= set(specs)
    assert specs["tiny"].base == "busybox" and specs["tiny"].is_builder
    assert specs["base"].base == "debootstrap"
    ci = specs["code-interpreter"]
    assert ci.base == "base" and ci.workdir == "/home/user"
    assert ci.steps[0].kind == "run" and "python3-numpy" in ci.steps[0].value
    assert all(tool in " ".join(st.value for st in ci.steps if st.kind == "run")
               for tool in ("procps", "iproute2", "curl", "git"))
    assert len({store.hash(n) for n in ("tiny", "base", "code-interpreter")}) == 3


def test_hash_changes_with_spec_and_parent(tmp_path: Path) -> None:
    write(tmp_path, "p", 'name = "p"\nfrom = "busybox"\n')
    write(tmp_path, "c", 'name = "c"\nfrom = "p"\n[[steps]]\nrun = "echo 1"\n')
    store = T.TemplateStore(tmp_path / "data", spec_dirs=[tmp_path])
    hp, hc = store.hash("p"), store.hash("c")
    assert store.hash("c") == hc                                     # stable
    write(tmp_path, "p", 'name = "p"\nfrom = "busybox"\n[env]\nX = "1"\n')
    assert store.hash("p") != hp and store.hash("c") != hc           # parent change rebuilds the child
    hc2 = store.hash("c")
    write(tmp_path, "c", 'name = "c"\nfrom = "p"\n[[steps]]\nrun = "echo 2"\n')
    assert store.hash("c") != hc2


def test_copy_source_content_is_hashed(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("one")
    write(tmp_path, "c", 'name = "c"\nfrom = "busybox"\n[[steps]]\ncopy = {src = "f.txt", dest = "/f"}\n')
    store = T.TemplateStore(tmp_path / "data", spec_dirs=[tmp_path])
    h = store.hash("c")
    (tmp_path / "f.txt").write_text("two")
    assert store.hash("c") != h


@pytest.mark.parametrize("body,msg", [
    ('from = "busybox"\n', "name"),
    ('name = "x"\n', "from"),
    ('name = "x"\nfrom = "busybox"\nbogus = 1\n', "unknown keys"),
    ('name = "x"\nfrom = "busybox"\nworkdir = "rel"\n', "workdir"),
    ('name = "x"\nfrom = "busybox"\n[[steps]]\nrun = ""\n', "run"),
    ('name = "x"\nfrom = "busybox"\n[[steps]]\nfrobnicate = "a"\n', "unknown step"),
    ('name = "x"\nfrom = "busybox"\n[[steps]]\ncopy = {src = "/etc/passwd", dest = "/p"}\n',
     "is absolute; write it relative to the spec file"),
    ('name = "x"\nfrom = "busybox"\n[[steps]]\ncopy = {src = "a"}\n', "copy"),
    ('name = "x"\nfrom = "x"\n', "itself"),
    ('name = "x"\nfrom = "busybox"\n[env]\nA = 1\n', "strings"),
    ('name = [\n', "bad.toml"),
])
def test_invalid_specs(tmp_path: Path, body: str, msg: str) -> None:
    with pytest.raises(T.TemplateSpecError, match=msg):
        T.parse_spec(write(tmp_path, "bad", body))


def test_cycle_and_unknown_parent(tmp_path: Path) -> None:
    write(tmp_path, "a", 'name = "a"\nfrom = "b"\n')
    write(tmp_path, "b", 'name = "b"\nfrom = "a"\n')
    write(tmp_path, "o", 'name = "o"\nfrom = "nope"\n')
    store = T.TemplateStore(tmp_path / "data", spec_dirs=[tmp_path])
    with pytest.raises(T.TemplateSpecError, match="cycle"):
        store.hash("a")
    with pytest.raises(TemplateNotFound):
        store.hash("o")


def test_get_unbuilt_and_unknown(tmp_path: Path) -> None:
    store = T.TemplateStore(tmp_path)
    with pytest.raises(TemplateNotFound, match="not built"):
        store.get("tiny")
    with pytest.raises(TemplateNotFound, match="no template spec"):
        store.get("does-not-exist")
    assert all(not s.built for s in store.list())


def test_env_and_workdir_resolution(tmp_path: Path) -> None:
    write(tmp_path, "c", 'name = "c"\nfrom = "busybox"\nworkdir = "/w"\n[env]\nA = "1"\nB = "1"\n'
                         '[[steps]]\nenv = {B = "2", C = "3"}\n[[steps]]\nworkdir = "/later"\n')
    s = T.parse_spec(tmp_path / "c.toml")
    parent = T.Template(name="p", layers=(), env={"P": "p", "A": "0"}, workdir="/p", hash="h")
    env, workdir = T.TemplateStore._resolve_env(s, parent)
    assert env == {"P": "p", "A": "1", "B": "2", "C": "3"}
    assert workdir == "/later"


def test_apt_mirror_from_env_then_apt_sources_else_an_error_naming_the_variable(tmp_path: Path) -> None:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    with pytest.raises(T.TemplateBuildError, match=T.MIRROR_ENV):
        T.apt_mirror(env={}, apt_dir=apt)
    (apt / "sources.list.d" / "other.sources").write_text("Types: deb\nURIs: http://mirror.invalid/vendor\n")
    with pytest.raises(T.TemplateBuildError, match=T.MIRROR_ENV):        # not a Debian archive
        T.apt_mirror(env={}, apt_dir=apt)
    (apt / "sources.list").write_text("deb http://list.invalid/debian bookworm main\n")
    assert T.apt_mirror(env={}, apt_dir=apt) == "http://list.invalid/debian"
    (apt / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://sec.invalid/debian-security\n\nTypes: deb\nURIs: http://deb822.invalid/debian/\n")
    assert T.apt_mirror(env={}, apt_dir=apt) == "http://deb822.invalid/debian"
    assert T.apt_mirror(env={T.MIRROR_ENV: "http://env.invalid/debian/"}, apt_dir=apt) == "http://env.invalid/debian"


def test_this_machines_apt_mirror_is_a_url() -> None:
    if not any(Path("/etc/apt").glob("sources.list*")):
        pytest.skip("this machine has no apt sources")
    assert T.apt_mirror(env={}).startswith(("http://", "https://"))


def test_copy_src_may_leave_the_spec_folder(tmp_path: Path) -> None:
    """``copy = {src = "../../env"}``: relative to the spec, outside its folder (an env next to the code)."""
    env = tmp_path / "project" / "env"
    env.mkdir(parents=True)
    (env / "episode.py").write_text("print(1)")
    specs = tmp_path / "project" / "cfg" / "templates"
    specs.mkdir(parents=True)
    write(specs, "c", 'name = "c"\nfrom = "busybox"\n[[steps]]\ncopy = {src = "../../env", dest = "/env"}\n')
    store = T.TemplateStore(tmp_path / "data", spec_dirs=[specs])
    h = store.hash("c")
    (env / "episode.py").write_text("print(2)")
    assert store.hash("c") != h                       # its content is hashed like any copy source
    write(specs, "c", 'name = "c"\nfrom = "busybox"\n[[steps]]\ncopy = {src = "../nope", dest = "/env"}\n')
    with pytest.raises(T.TemplateSpecError, match="copy source missing: .*relative to the spec's folder"):
        store.hash("c")


def test_build_errors_are_one_line() -> None:
    err = T.TemplateBuildError("template x: step 2/3 `pip install nope` failed (exit 1)",
                               "Collecting nope\n  lots of lines\nERROR: No matching distribution found for nope\n\n",
                               log_path=Path("/d/templates/x/build.log"))
    assert "\n" not in str(err)
    assert str(err) == ("template x: step 2/3 `pip install nope` failed (exit 1): ERROR: No matching "
                        "distribution found for nope (full log: /d/templates/x/build.log)")


def test_build_steps_get_the_hosts_proxy_and_ca(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ca = tmp_path / "corp-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("no_proxy", "localhost")
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    assert T.host_ca_bundle() == ca
    env = T.build_step_env({"PIP_INDEX_URL": "x"}, ca_in_root=True)
    assert env["https_proxy"] == env["HTTPS_PROXY"] == "http://proxy.internal:3128"
    assert env["no_proxy"] == env["NO_PROXY"] == "localhost"
    assert env["PIP_CERT"] == env["REQUESTS_CA_BUNDLE"] == env["SSL_CERT_FILE"] == T.BUILD_CA
    assert env["PIP_INDEX_URL"] == "x" and env["PATH"] == T.BUILD_PATH
    root = tmp_path / "root"
    (root / "tmp").mkdir(parents=True)
    (root / "etc" / "apt" / "apt.conf.d").mkdir(parents=True)
    with T._host_network_settings(root) as ca_in:
        assert ca_in and (root / T.BUILD_CA.lstrip("/")).read_text() == ca.read_text()
        conf = (root / T.BUILD_APT_CONF.lstrip("/")).read_text()
        assert 'Acquire::https::Proxy "http://proxy.internal:3128";' in conf and T.BUILD_CA in conf
    # nothing of the host's settings stays in the layer
    assert not (root / T.BUILD_CA.lstrip("/")).exists() and not (root / T.BUILD_APT_CONF.lstrip("/")).exists()


def test_a_bad_spec_is_skipped_and_reported_never_fatal(tmp_path: Path) -> None:
    """A typo in one spec (here a broken TOML table) must not take the other templates, or a node, down."""
    write(tmp_path, "good", 'name = "good"\nfrom = "busybox"\n')
    write(tmp_path, "bad-toml", 'name = "bad"\nfrom = "busybox"\n[[steps]\nrun = "x"\n')
    write(tmp_path, "empty-run", 'name = "empty"\nfrom = "busybox"\n[[steps]]\nrun = ""\n')
    store = T.TemplateStore(tmp_path / "data", spec_dirs=[T.SPEC_DIR, tmp_path])
    specs = store.specs()
    assert "good" in specs and "tiny" in specs and "bad" not in specs and "empty" not in specs
    assert set(store.spec_errors) == {str(tmp_path / "bad-toml.toml"), str(tmp_path / "empty-run.toml")}
    assert {s.name for s in store.list()} >= {"good", "tiny"}
    with pytest.raises(TemplateNotFound, match="skipped invalid specs: .*bad-toml.toml"):
        store.spec("bad")
