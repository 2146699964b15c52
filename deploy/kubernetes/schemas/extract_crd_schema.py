"""Pin one served version of a CRD's openAPIV3Schema as JSON, for the recipes' tests.

    git show TAG:config/crd/.../FILE.yaml | python extract_crd_schema.py VERSION SOURCE > OUT

String ``description`` fields are dropped (they are most of the bytes and validate
nothing); everything else, the CEL ``x-kubernetes-validations`` included, is kept as
published. ``SOURCE`` (repository, tag, commit, path) is recorded under ``x-pinned-from``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml


def without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            key: without_descriptions(value)
            for key, value in node.items()
            if not (key == "description" and isinstance(value, str))
        }
    if isinstance(node, list):
        return [without_descriptions(item) for item in node]
    return node


def version_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise SystemExit(f"{crd['metadata']['name']} has no version {version!r}")


def main() -> None:
    version, source = sys.argv[1], sys.argv[2]
    crd = yaml.safe_load(sys.stdin)
    schema = without_descriptions(version_schema(crd, version))
    pinned = {
        "x-pinned-from": source,
        "x-crd": f"{crd['metadata']['name']}/{version}",
        **schema,
    }
    json.dump(pinned, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
