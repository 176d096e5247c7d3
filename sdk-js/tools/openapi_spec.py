"""Print the control plane's OpenAPI document (built from the app, no server needed) plus the data-plane
models the node serves on the same paths (``RunRequest``, ``RunEvent``, ``FileInfo``, archive answers),
which the app's proxied routes do not declare. ``openapi-typescript`` turns it into
``src/generated/openapi.ts``; ``scripts/test-js`` checks that file is current.

Usage: python tools/openapi_spec.py > openapi.json
"""

from __future__ import annotations

import json
import sys

from pydantic import BaseModel

from pilldrops.schema.api import FileInfo, RunEvent, RunRequest
from pilldrops.server.api.app import Services, create_app


class FileList(BaseModel):
    items: list[FileInfo]


class ArchiveUploaded(BaseModel):
    entries: int


DATA_PLANE = (RunRequest, RunEvent, FileInfo, FileList, ArchiveUploaded)


def spec() -> dict:  # type: ignore[type-arg]
    app = create_app(Services(auth=None, sandboxes=None, nodes=None, billing=None, pools=None))  # type: ignore[arg-type]
    doc = app.openapi()
    doc["info"]["version"] = "v1"  # the wire version, not the package's (keeps the generated file stable)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in DATA_PLANE:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in js.pop("$defs", {}).items():
            schemas.setdefault(name, sub)
        schemas[model.__name__] = js
    return doc


if __name__ == "__main__":
    json.dump(spec(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
