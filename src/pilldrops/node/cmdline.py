"""A command line a shell would run as one plain command, run without the shell (issue 15: ``run("true")``
forks and execs ``sh`` first otherwise, a third of the command's cost in the sandbox).

Only lines whose words are all of ``[A-Za-z0-9_./:,+@%=-]`` separated by spaces or tabs qualify: no quotes,
escapes, ``$``, globs, ``~``, redirections, pipes, separators, newlines, comments or braces, so the shell's
word splitting is exactly ``str.split``. The first word must not be an assignment (``A=1 cmd``), a shell
keyword or a builtin (``cd``, ``exit``, ``echo``, ``export``...: they run inside the shell or differ from
the external command of the same name), except ``true`` and ``false``, whose external commands do the same.
Everything else keeps ``/bin/sh -c``. The command's environment always has PATH: the runtimes start
commands with the sandbox's process environment (``oci_spec.merged_env``: PATH defaults to ``DEFAULT_PATH``,
the shell's own default directories) under the template's and the request's. What stays the same: the PATH lookup (pd-init's ``execvp`` with the
command's environment), exit 127 when it is not found and 126 when it cannot be executed, the environment
and the working directory. What differs: the not-found message on stderr is pd-init's, not the shell's,
and ``true``/``false`` need ``/bin/true``/``/bin/false`` (or elsewhere on PATH) in the template.
"""

from __future__ import annotations

import re

_LINE = re.compile(r"[ \t]*[A-Za-z0-9_./:,+@%=-]+(?:[ \t]+[A-Za-z0-9_./:,+@%=-]+)*[ \t]*")
_SHELL_WORDS = frozenset("""
    ! { } [[ ]] case do done elif else esac fi for function if in select then until while time coproc
    . : [ alias bg bind break builtin caller cd chdir command compgen complete continue declare dirs disown
    echo enable eval exec exit export fc fg getopts hash help history jobs kill let local logout mapfile
    popd printf pushd pwd read readarray readonly return set shift shopt source suspend test times trap
    type typeset ulimit umask unalias unset wait
""".split())  # noqa: SIM905 - one readable block of words


def shell_free_argv(cmd: str) -> list[str] | None:
    """The argv ``/bin/sh -c cmd`` would exec, when running it directly means the same; else None."""
    if len(cmd) > 4096 or not _LINE.fullmatch(cmd):
        return None
    argv = cmd.split()
    if "=" in argv[0] or argv[0] in _SHELL_WORDS:
        return None
    return argv
