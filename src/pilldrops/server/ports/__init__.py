"""Ports inside sandboxes reached through the control plane: signed URLs (``signing``), the byte relay over
a node's port tunnel (``relay``) and the gateway that authorizes and routes each request (``gateway``)."""
