"""Wire shapes of the data plane's filesystem routes (``/v1/sandboxes/{id}/fs/...``, docs/api.md)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pilldrops.schema.api import FileInfo


class FileEntry(FileInfo):
    owner: str = ""
    group: str = ""
    permissions: str = ""               # as `ls -l` shows them, e.g. "-rw-r--r--"
    symlink_target: str | None = None


class FileListing(BaseModel):
    items: list[FileEntry]
    truncated: bool = False             # more entries than one listing returns


class PathRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    path: str = Field(..., min_length=1, max_length=4096)


class MoveRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    source: str = Field(..., min_length=1, max_length=4096)
    destination: str = Field(..., min_length=1, max_length=4096)
