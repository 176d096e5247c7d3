"""Wire contract (pydantic only, no I/O). ``api`` is the public REST surface, ``node`` the node API."""
