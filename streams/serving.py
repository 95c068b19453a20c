"""What answers a pipeline's batches: the serving model and an optional candidate, in
canary (a sticky share of keys answers with it) or shadow (it scores after the serving
answer is published, elsewhere).

A `Serving` is replaced whole between batches (`Pipeline.use`): each batch reads the
reference once when it is prepared and keeps it to the end, so a switch costs the hot
path one attribute read per batch, no lock. It counts the batches still using it, so
the models it retires are closed only once none does.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Literal

from streams.guardrail import VersionMeter
from streams.infer import Model
from streams.records import Item

Mode = Literal["canary", "shadow"]
_BUCKETS = 10_000


class Serving:
    __slots__ = ("canary_buckets", "candidate", "candidate_meter", "in_use", "meter", "mode",
                 "model")  # fmt: skip

    def __init__(
        self,
        model: Model,
        candidate: Model | None = None,
        mode: Mode | None = None,
        canary_percent: float = 0.0,
    ) -> None:
        self.model = model
        self.candidate = candidate
        self.mode = mode if candidate is not None else None
        # No candidate (refused): no canary share, so it equals a Serving without one.
        canary = self.mode == "canary"
        self.canary_buckets = round(canary_percent * _BUCKETS / 100) if canary else 0
        self.in_use = 0
        """Batches prepared with it and not yet done (read from another thread)."""
        self.meter: VersionMeter | None = None
        self.candidate_meter: VersionMeter | None = None
        """Each model's answers, metered for its guardrail (bound by `Pipeline.use`)."""

    @property
    def canary(self) -> bool:
        return self.mode == "canary" and self.canary_buckets > 0

    @property
    def shadow(self) -> bool:
        return self.mode == "shadow"

    def split(self, items: Sequence[Item]) -> tuple[list[Item], list[Item]]:
        """(the serving model's items, the canary's): a key is on the canary side when
        its CRC-32 falls in the canary's share of buckets, so one entity always lands on
        the same side. Keyless records go to the serving model: as one key they would
        all land on one side, whatever the share."""
        buckets = self.canary_buckets
        serving, canary = [], []
        for item in items:
            key = item.record.key
            (canary if key and zlib.crc32(key) % _BUCKETS < buckets else serving).append(item)
        return serving, canary

    def models(self) -> list[Model]:
        return [self.model] if self.candidate is None else [self.model, self.candidate]
