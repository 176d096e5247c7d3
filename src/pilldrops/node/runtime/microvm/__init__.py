"""Pieces of the microVM runtime (``runtime/qemu.py``): ``guest`` (kernel, initramfs, root disks),
``vm`` (QEMU processes), ``snapshot`` (one boot per template), ``channel`` (the agent port) and ``qmp``.
``pd-vmagent.c`` is the guest's PID 1 and the guest end of the agent port.
"""
