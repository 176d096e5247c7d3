from __future__ import annotations

import inspect

import pilldrops
from pilldrops import errors


def test_all_lists_exactly_the_public_names() -> None:
    public = {name for name in dir(pilldrops) if not name.startswith("_")} | {"__version__"}
    public -= {name for name, obj in vars(pilldrops).items() if inspect.ismodule(obj)}
    assert set(pilldrops.__all__) == public
    assert sorted(pilldrops.__all__, key=str.lower) == sorted(set(pilldrops.__all__), key=str.lower)


def test_every_error_class_is_exported() -> None:
    for name, obj in vars(errors).items():
        if inspect.isclass(obj) and issubclass(obj, errors.PillDropsError):
            assert getattr(pilldrops, name) is obj


def test_sync_and_async_twins_have_the_same_methods() -> None:
    def methods(cls: type) -> set[str]:
        return {n for n in dir(cls) if not n.startswith("__")} - {"__aenter__", "__aexit__"}

    assert methods(pilldrops.Sandbox) == methods(pilldrops.AsyncSandbox)
    sig = inspect.signature(pilldrops.Sandbox.run)
    assert list(sig.parameters) == list(inspect.signature(pilldrops.AsyncSandbox.run).parameters)
    assert not inspect.iscoroutinefunction(pilldrops.Sandbox.run)
    assert inspect.iscoroutinefunction(pilldrops.AsyncSandbox.run)
