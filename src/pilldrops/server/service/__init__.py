"""Use cases of the control plane. Raise ``pilldrops.errors`` types; never speak HTTP."""
