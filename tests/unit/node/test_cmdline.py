"""Which command lines run without ``/bin/sh`` (node/cmdline.py): plain words only, never a builtin,
keyword or assignment first, never anything the shell would expand, split or redirect."""

from __future__ import annotations

import pytest

from pilldrops.node.cmdline import shell_free_argv


@pytest.mark.parametrize(("cmd", "argv"), [
    ("true", ["true"]),
    ("false", ["false"]),
    ("  ls -la /tmp  ", ["ls", "-la", "/tmp"]),
    ("python3 -m http.server 8000", ["python3", "-m", "http.server", "8000"]),
    ("/usr/bin/env A=1 B=x,y:z@h%1+2", ["/usr/bin/env", "A=1", "B=x,y:z@h%1+2"]),
    ("tar\t-xf\tarchive.tar", ["tar", "-xf", "archive.tar"]),
])
def test_plain_lines_become_argv(cmd: str, argv: list[str]) -> None:
    assert shell_free_argv(cmd) == argv


@pytest.mark.parametrize("cmd", [
    "", "   ", "echo hi", "cd /tmp", "exit 3", "export A=1", "A=1 env", "pwd", "test -e x", "[ -e x ]",
    "kill 1", "printf x", "exec ls", ". ./env", ": nothing", "if true", "time ls", "ls; rm x", "ls && ls",
    "ls | wc", "ls > out", "ls < in", "ls &", "echo $HOME", "ls ~", "ls *.py", "ls a?", "ls [ab]",
    "ls 'a b'", 'ls "a"', "ls a\\ b", "ls `x`", "ls $(x)", "ls {a,b}", "ls # c", "ls\nrm x", "ls\rx",
    "x" * 5000,
])
def test_everything_else_keeps_the_shell(cmd: str) -> None:
    assert shell_free_argv(cmd) is None
