"""Render a kustomization of deploy/k8s offline, without kustomize: the subset these manifests use.

    python deploy/k8s/render.py deploy/k8s/overlays/cpu-local > rendered.yaml

`kubectl kustomize DIR` (or `kustomize build DIR`) gives the same objects where it is installed;
the tests check that, and validate what this renders against the Kubernetes JSON schemas
wherever kubectl is missing. Supported kustomization fields, applied in kustomize's order:

- `resources`: YAML files (several documents each) and directories holding a kustomization;
- `patches`: JSON 6902 patches (`add`, `replace`, `remove`; inline `patch` or a `path`), each
  with a `target` selected by `kind` and `name`;
- `namespace`: set on every namespaced object;
- `images`: `newName`, `newTag` or `digest` for matching container images.

Anything else in a kustomization is refused, so the renderer can never silently differ.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "patches", "namespace", "images"}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
}


def render(directory: str | Path) -> list[dict[str, Any]]:
    """The objects a kustomization directory stands for, in the order its resources list them."""
    directory = Path(directory)
    kust_file = directory / "kustomization.yaml"
    if not kust_file.is_file():
        raise ValueError(f"{directory}: no kustomization.yaml")
    kust = yaml.safe_load(kust_file.read_text()) or {}
    unknown = set(kust) - SUPPORTED
    if unknown:
        raise ValueError(
            f"{kust_file}: fields {sorted(unknown)} are not supported by this renderer (only {sorted(SUPPORTED)}); use kubectl kustomize"
        )
    objects: list[dict[str, Any]] = []
    for entry in kust.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in kust.get("patches", []):
        ops = yaml.safe_load(
            patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text()
        )
        target = patch["target"]
        if set(target) - {"kind", "name"} or not isinstance(ops, list):
            raise ValueError(
                f"{kust_file}: only JSON 6902 patches with a target of kind and name are supported"
            )
        matched = [
            o
            for o in objects
            if o["kind"] == target.get("kind", o["kind"])
            and o["metadata"]["name"] == target.get("name", o["metadata"]["name"])
        ]
        if not matched:
            raise ValueError(f"{kust_file}: patch target {target} matches no object")
        for obj in matched:
            for op in ops:
                _apply(obj, op)
    if "namespace" in kust:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kust["namespace"]
    for image in kust.get("images", []):
        for obj in objects:
            for container in _containers(obj):
                container["image"] = _retag(container["image"], image)
    return objects


def _apply(obj: dict[str, Any], op: dict[str, Any]) -> None:
    """One JSON 6902 operation (RFC 6902: add, replace, remove) on obj, in place."""
    keys = [k.replace("~1", "/").replace("~0", "~") for k in op["path"].split("/")[1:]]
    parent: Any = obj
    for key in keys[:-1]:
        parent = parent[int(key)] if isinstance(parent, list) else parent[key]
    last = keys[-1]
    kind = op["op"]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if kind == "add":
            parent.insert(index, copy.deepcopy(op["value"]))
        elif kind == "replace":
            parent[index] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[index]
        else:
            raise ValueError(f"JSON patch op {kind!r} is not supported (add, replace, remove)")
        return
    if kind in ("replace", "remove") and last not in parent:
        raise ValueError(f"JSON patch {kind} {op['path']}: no such field")
    if kind in ("add", "replace"):
        parent[last] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del parent[last]
    else:
        raise ValueError(f"JSON patch op {kind!r} is not supported (add, replace, remove)")


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {})
    pod = (
        spec.get("jobTemplate", {})
        .get("spec", spec)
        .get("template", {})
        .get("spec", spec if obj["kind"] == "Pod" else {})
    )
    return pod.get("containers", []) + pod.get("initContainers", [])


def _retag(ref: str, image: dict[str, str]) -> str:
    name, tag = ref, ""
    if "@" in name:
        name, tag = name.split("@", 1)
        tag = "@" + tag
    elif ":" in name.rsplit("/", 1)[-1]:
        name, t = name.rsplit(":", 1)
        tag = ":" + t
    if name != image["name"]:
        return ref
    name = image.get("newName", name)
    if "digest" in image:
        tag = "@" + image["digest"]
    elif "newTag" in image:
        tag = ":" + image["newTag"]
    return name + tag


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python deploy/k8s/render.py KUSTOMIZATION_DIR", file=sys.stderr)
        return 2
    yaml.safe_dump_all(render(argv[0]), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
