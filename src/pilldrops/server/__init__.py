"""Control plane: api → service → {scheduler, store, nodes} → domain. Never touches cgroups or mounts."""
