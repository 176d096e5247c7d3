"""What the node keeps per live sandbox, kept small (issue 15 session 7: host memory at 1,000 live)."""

from __future__ import annotations

import anyio
import pytest

from pilldrops.node.registry import Sandbox
from pilldrops.node.runtime import base
from pilldrops.node.runtime.base import shared_env


def test_sandboxes_with_one_environment_share_one_dict() -> None:
    a = shared_env({"PATH": "/bin", "HOME": "/root"})
    b = shared_env({"PATH": "/bin", "HOME": "/root"})
    c = shared_env({"PATH": "/bin", "HOME": "/home/u"})
    assert a is b and a == {"PATH": "/bin", "HOME": "/root"}
    assert c is not a and c["HOME"] == "/home/u"
    assert shared_env({"HOME": "/root", "PATH": "/bin"}) == a       # order kept, content equal


def test_an_environment_goes_with_the_last_sandbox_that_had_it() -> None:
    import gc

    held = [shared_env({"X": str(i), "SECRET": "s3cret"}) for i in range(300)]
    assert all(("X", str(i)) in base._ENVS.get(tuple(h.items()), {}).items() for i, h in enumerate(held))
    del held
    gc.collect()
    assert not any(k for k in base._ENVS if ("SECRET", "s3cret") in k)   # nothing kept once unused


@pytest.mark.anyio
async def test_a_sandbox_makes_its_op_lock_on_first_use() -> None:
    sb = Sandbox.__new__(Sandbox)
    sb._op = None
    assert sb._op is None
    lock = sb.op
    assert isinstance(lock, anyio.Lock) and sb.op is lock
    async with sb.op:
        assert lock.locked()
