"""Host-side isolation plumbing for the crun runtime and the template builder.

Owns: host preparation (``host``), mount(2)/umount2(2) via ctypes (``mounts``), cgroup v1 helpers
(``cgroups``) and process-tree helpers (``procs``). Nothing here knows about the agent.
"""
