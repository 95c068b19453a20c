"""Reading and writing a pipeline's records from the tools (produce, consume, audit,
demo, benchmarks), for any pipeline of a config, with or without a registry."""

from __future__ import annotations

import math
from typing import Any

from schemas.catalogue import LocalCatalogue, SchemaCatalogue, open_catalogue
from schemas.codec import AvroDecoder, AvroEncoder
from streams.app import answer_schema_of, input_schema
from streams.config import HeadraceConfig, PipelineConfig


def catalogue_of(config: HeadraceConfig) -> SchemaCatalogue:
    return open_catalogue(config.registry)


def answer_decoder(config: HeadraceConfig, catalogue: SchemaCatalogue | None = None) -> AvroDecoder:
    """Decodes any answer of the config's pipelines as it was written (its writer schema,
    by id). Without a registry, the local catalogue learns the pipelines' derived answer
    schemas first, so their computed ids resolve."""
    catalogue = catalogue or catalogue_of(config)
    if isinstance(catalogue, LocalCatalogue):
        for spec in config.pipelines:
            catalogue.id_for(f"{spec.output_topic}-value", answer_schema_of(spec, catalogue))
    return AvroDecoder(catalogue, None)


def event_encoder(
    config: HeadraceConfig, spec: PipelineConfig, catalogue: SchemaCatalogue | None = None
) -> AvroEncoder:
    """Frames events of a pipeline's input schema as a producer would (with a registry,
    registered under `<input_topic>-value`)."""
    catalogue = catalogue or catalogue_of(config)
    return AvroEncoder(catalogue, input_schema(spec, catalogue), f"{spec.input_topic}-value")


def json_safe(answer: dict[str, Any]) -> dict[str, Any]:
    """NaN (a SHED answer's score or value) as null: JSON has no NaN."""
    return {
        key: None if isinstance(value, float) and math.isnan(value) else value
        for key, value in answer.items()
    }
