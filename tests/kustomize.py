"""Renders deploy/kubernetes/ overlays as ``kubectl kustomize`` does, for CI without kubectl.

Neither kubectl nor kustomize installs from the package registries CI reaches, so the tests
render the overlays with this subset of kustomize: ``resources`` (files and directories with a
kustomization), ``patches`` given by ``path`` holding a strategic-merge patch, and ``images``
(``newName``, ``newTag``). Anything else in a kustomization is refused, so the manifests cannot
grow a feature this renders wrongly. Where kubectl is installed, a test checks that both
render the same objects, in the same order inside each list.

Strategic merge, as the Kubernetes API defines it for the fields used here: maps merge key by
key; the lists below merge item by item on their key (containers by name, mounts by path); any
other list is replaced whole, as ``args`` and ``command`` are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION = "kustomization.yaml"
SUPPORTED = {"apiVersion", "kind", "resources", "patches", "images"}
# patchMergeKey of the Kubernetes API's lists that these manifests patch.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "ports": "containerPort",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "resourceClaims": "name",
}

Object = dict[str, Any]


class KustomizeError(ValueError):
    pass


def render(directory: Path) -> list[Object]:
    """The objects the kustomization in ``directory`` builds, images set and patches applied."""
    spec = yaml.safe_load((directory / KUSTOMIZATION).read_text())
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise KustomizeError(f"{directory / KUSTOMIZATION}: not supported here: {sorted(unknown)}")
    objects: list[Object] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [o for o in yaml.safe_load_all(path.read_text()) if o]
    for entry in spec.get("patches", []):
        if set(entry) != {"path"}:
            raise KustomizeError(f"{directory}: a patch is a path to a strategic-merge patch")
        patch = yaml.safe_load((directory / entry["path"]).read_text())
        target = _find(objects, patch, directory / entry["path"])
        objects[objects.index(target)] = merge(target, patch)
    for image in spec.get("images", []):
        for obj in objects:
            _set_image(obj, image)
    return objects


def merge(original: Any, patch: Any, field: str = "") -> Any:
    """``patch`` merged into ``original`` as a strategic-merge patch (see above)."""
    if isinstance(original, dict) and isinstance(patch, dict):
        if any(key.startswith("$") for key in patch):
            raise KustomizeError(f"{field}: patch directives are not supported here")
        out = dict(original)
        for key, value in patch.items():
            out[key] = merge(original[key], value, key) if key in original else value
        return out
    key = MERGE_KEYS.get(field)
    if isinstance(original, list) and isinstance(patch, list) and key is not None:
        # kustomize's order: the patch's items first (merged into their originals), then the
        # originals it did not name.
        by_key = {item[key]: item for item in original}
        named = {item[key] for item in patch}
        merged = [merge(by_key[i[key]], i, field) if i[key] in by_key else i for i in patch]
        return merged + [item for item in original if item[key] not in named]
    return patch


def _find(objects: list[Object], patch: Object, source: Path) -> Object:
    for obj in objects:
        if obj["kind"] == patch["kind"] and obj["metadata"]["name"] == patch["metadata"]["name"]:
            return obj
    raise KustomizeError(f"{source}: no {patch['kind']} {patch['metadata']['name']} to patch")


def _set_image(obj: Object, image: dict[str, str]) -> None:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    for container in spec.get("initContainers", []) + spec.get("containers", []):
        ref = container["image"].split("@")[0]
        name, colon, tag = ref.rpartition(":")
        if not colon or "/" in tag:  # no tag: the colon was a registry's port, or absent
            name, tag = ref, ""
        if name == image["name"]:
            tag = image.get("newTag", tag)
            container["image"] = image.get("newName", name) + (f":{tag}" if tag else "")
