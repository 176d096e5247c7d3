"""Runtime drivers behind the seam in ``base``: ``crun`` (the product path) and ``fake`` (unit tests only).

Import drivers from their modules (``pilldrops.node.runtime.crun.CrunRuntime``,
``pilldrops.node.runtime.fake.FakeRuntime``); this package imports nothing heavy on purpose.
"""
