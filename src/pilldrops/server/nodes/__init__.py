"""Calling node agents: the control plane's only way to act on sandboxes."""
