"""Configuration of the feature stage: the Feast repo and each pipeline's cache."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from schemas.config import FrozenModel, resolve_path


class FeaturesConfig(FrozenModel):
    repo_path: Path = Path("features/repo")
    """Folder of the Feast repo (`feature_store.yaml`)."""

    _resolve_repo = field_validator("repo_path")(resolve_path)


class FeatureCacheConfig(FrozenModel):
    max_entries: int = Field(100_000, ge=0, le=100_000_000)
    """Rows kept per feature view (LRU); 0 turns the cache off."""
    max_staleness_s: float = Field(30.0, ge=0, le=86_400)
    """How long a cached row is served before it is read from the store again."""
    whole_view_max_entities: int = Field(20_000, ge=0, le=10_000_000)
    """A SQLite view with values for at most this many entities (keyed by one string or
    integer) is read whole at start and again when the store changes
    (`features/whole.py`); 0 reads every view per key. Off with the cache."""
