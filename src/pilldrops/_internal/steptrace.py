"""TEMP (session 7, cold-create profiling): PILLDROPS_STEPTRACE=<file> appends "pid step ns" lines."""
import os
import time

_F = os.environ.get("PILLDROPS_STEPTRACE")
_fd = os.open(_F, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if _F else None


def mark(step: str) -> None:
    if _fd is not None:
        os.write(_fd, f"{os.getpid()} {step} {time.perf_counter_ns()}\n".encode())
