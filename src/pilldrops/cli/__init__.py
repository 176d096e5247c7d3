"""The ``pilldrops`` command line (click + rich). Entry point: :func:`pilldrops.cli.main.main`."""
