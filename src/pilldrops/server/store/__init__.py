"""Persistence of the control plane's state: SQLite (embedded) or PostgreSQL (fleet), via SQLAlchemy 2.

The schema is owned by Alembic migrations (``migrations/``); ``models.py`` mirrors it for queries.
"""
