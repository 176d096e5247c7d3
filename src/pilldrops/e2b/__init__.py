"""The E2B-compatible surface: the stock ``e2b`` / ``e2b-code-interpreter`` SDKs (Python and JS) run unchanged
against a PillDrops server.

- ``routing``: the one-port rule (``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port`` headers, ``{port}-{id}.`` hosts,
  access tokens) that sends sandbox traffic to envd (``envd``), the code interpreter or a user port;
- ``rest``: the E2B control-plane REST routes, mapped onto the same services as ``/v1``;
- ``code_interpreter``: ``/execute`` and ``/contexts``, relayed to a Jupyter-kernel driver in the sandbox;
- ``ports``: the shared port relay (``server.ports``) addressed by a ``SandboxRef`` (user ports themselves go
  through the port gateway, ``server.ports.gateway``).
"""
