"""`headrace check`: every pipeline of a config loaded without Kafka (schema, feature
service, models), its resolved column map, its answer schema, and every problem found."""

from __future__ import annotations

from contextlib import ExitStack

from schemas.catalogue import LocalCatalogue, SchemaCatalogue
from streams.app import Inspection, inspect_pipeline, open_store_for
from streams.config import HeadraceConfig
from tools.answers import catalogue_of


def inspect_all(config: HeadraceConfig, resources: ExitStack) -> list[Inspection]:
    catalogue = catalogue_of(config)
    try:
        store = open_store_for(config)
    except Exception as exc:  # reported per pipeline below, with the rest
        store, store_problem = None, str(exc)
    else:
        store_problem = None
    found = []
    for spec in config.pipelines:
        inspection = inspect_pipeline(spec, catalogue, store, resources)
        if store_problem and spec.feature_service:
            inspection.problems.insert(0, store_problem)
        found.append(inspection)
    return found


def report(found: Inspection, catalogue: SchemaCatalogue | None = None) -> list[str]:
    """What a pipeline reads, from where, and what it writes; its problems last."""
    spec = found.spec
    lines = [f"pipeline {spec.name}: {spec.input_topic} -> {spec.output_topic}"]
    if found.schema is not None:
        source = spec.input.schema_path or f"registry subject {spec.input.subject}"
        lines.append(f"  input {found.schema['name']} ({source}): {', '.join(found.fields)}")
    if found.rules is not None:
        lines += [f"    validate {rule}" for rule in found.rules.describe()]
    if found.lookup is not None:
        lines.append(f"  features {spec.feature_service}: {', '.join(found.feature_refs)}")
    for role, signature in (("model", found.signature), ("fallback", found.fallback)):
        if signature is None:
            continue
        lines.append(f"  {role} {signature.name} v{signature.version}:")
        for line in signature.describe():
            where = ""
            source = line.strip().split(" ")[0]
            if line.startswith("  ") and source in found.feature_refs:
                where = "  <- store"
            elif line.startswith("  ") and source in found.fields:
                where = "  <- event"
            lines.append(f"    {line}{where}")
    if found.answers is not None:
        names = [field["name"] for field in found.answers["fields"]]
        lines.append(f"  answers {found.answers['name']}: {', '.join(names)}")
        if isinstance(catalogue, LocalCatalogue):
            schema_id = catalogue.id_for(f"{spec.output_topic}-value", found.answers)
            lines.append(f"    schema id {schema_id} (local catalogue)")
    lines += [f"  PROBLEM: {problem}" for problem in found.problems]
    return lines
