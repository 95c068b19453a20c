"""Render a Kustomize overlay: `kubectl kustomize` where kubectl is installed, else a
small PyYAML rendering of the features `infra/k8s` uses (resources, labels with
selectors, configMapGenerator, namespace, images, patches merged by kind and name;
generated names without their hash suffix)."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]


def render(folder: Path) -> list[Doc]:
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True,
                             text=True, check=True, timeout=60).stdout  # fmt: skip
        return [doc for doc in yaml.safe_load_all(out) if doc]
    return render_in_python(folder)


def render_in_python(folder: Path) -> list[Doc]:
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[Doc] = []
    for resource in spec.get("resources", []):
        path = folder / resource
        if path.is_dir():
            docs += render_in_python(path)
        else:
            docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for generator in spec.get("configMapGenerator", []):
        data = {Path(f).name: (folder / f).read_text() for f in generator["files"]}
        made = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]},
                "data": data}  # fmt: skip
        for doc in docs:  # behavior: replace keeps the base's metadata (its labels)
            if _key(doc) == _key(made):
                doc["data"] = data
                break
        else:
            docs.append(made)
    for label in spec.get("labels", []):
        for doc in docs:
            _add_labels(doc, label["pairs"], label.get("includeSelectors", False))
    for patch in spec.get("patches", []):
        change = yaml.safe_load((folder / patch["path"]).read_text())
        for doc in docs:
            if _key(doc) == _key(change):
                _merge(doc, change)
    for image in spec.get("images", []):
        for doc in docs:
            for container in _containers(doc):
                name, _, _tag = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    if "namespace" in spec:
        for doc in docs:
            doc["metadata"]["namespace"] = spec["namespace"]
    return docs


def _key(doc: Doc) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def _add_labels(doc: Doc, pairs: dict[str, str], selectors: bool) -> None:
    doc["metadata"].setdefault("labels", {}).update(pairs)
    if not selectors:
        return
    spec = doc.get("spec", {})
    if doc["kind"] == "Deployment":
        spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(pairs)
        spec["template"]["metadata"].setdefault("labels", {}).update(pairs)
    elif doc["kind"] == "Service":
        spec.setdefault("selector", {}).update(pairs)
    elif doc["kind"] == "PodDisruptionBudget":
        spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(pairs)


def _merge(into: Doc, change: Doc) -> None:
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def _containers(doc: Doc) -> list[Doc]:
    if doc["kind"] != "Deployment":
        return []
    return doc["spec"]["template"]["spec"]["containers"]
