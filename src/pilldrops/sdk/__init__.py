"""The PillDrops Python SDK. Public names are re-exported from :mod:`pilldrops`.

``_async/`` is the source of truth; ``_sync/`` is generated from it by ``scripts/unasync.py``.
Everything that does no I/O lives in ``_base.py``.
"""
