"""Regenerate the vendored CRD schemas of this folder from the upstream CRD files.

    python tests/deploy/schemas/vendor.py CRD_FILE KIND VERSION OUT.json --source "repo@tag:path"

Reads a CustomResourceDefinition YAML file (several documents allowed, e.g. Istio's crd-all), takes
the ``openAPIV3Schema`` of ``KIND`` at ``VERSION``, removes every ``description`` (they are most of
the bytes and carry no rule), and writes it as JSON with the source noted under ``x-vendored-from``.
SOURCES.md lists the files, their upstream repositories, tags and paths. Nothing else is changed:
the strictness the tests add (unknown fields refused, as ``kubectl apply`` does by default) is
applied when they load a schema, not here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def strip_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        # "description" is a field name in some schemas (e.g. a property called description):
        # only drop it where it is a string, i.e. the keyword.
        return {k: strip_descriptions(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def find_schema(documents: list[Any], kind: str, version: str) -> dict[str, Any]:
    for doc in documents:
        if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
            continue
        spec = doc["spec"]
        if spec["names"]["kind"] != kind:
            continue
        for entry in spec["versions"]:
            if entry["name"] == version:
                return {"group": spec["group"], "schema": entry["schema"]["openAPIV3Schema"]}
    raise SystemExit(f"no CRD for kind {kind} version {version}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("crd_file", type=Path)
    parser.add_argument("kind")
    parser.add_argument("version")
    parser.add_argument("out", type=Path)
    parser.add_argument("--source", required=True, help="repository@tag:path, recorded in the output")
    args = parser.parse_args()
    documents = list(yaml.safe_load_all(args.crd_file.read_text()))
    found = find_schema(documents, args.kind, args.version)
    schema = strip_descriptions(found["schema"])
    schema["x-vendored-from"] = {"source": args.source, "apiVersion": f"{found['group']}/{args.version}",
                                 "kind": args.kind, "changes": "descriptions removed"}
    args.out.write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
