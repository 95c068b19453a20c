"""The Confluent wire format: round trips and every way a record can be unreadable."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.catalogue import LOCAL_IDS, LocalCatalogue, load_schema
from schemas.codec import AvroDecoder, AvroEncoder
from schemas.errors import DecodeError, SchemaNotFoundError

EVENT = {
    "event_id": "e-1",
    "user_id": "u0000001",
    "merchant_id": "m000001",
    "amount": 12.5,
    "hour_of_day": 3,
    "is_online": True,
    "event_time_ms": 1_700_000_000_000,
    "priority": None,
}


@pytest.fixture
def encoder() -> AvroEncoder:
    return AvroEncoder(LocalCatalogue(), "transaction.avsc", "transactions-value")


@pytest.fixture
def decoder() -> AvroDecoder:
    return AvroDecoder(LocalCatalogue(), "transaction.avsc")


def test_round_trip_with_confluent_framing(encoder, decoder):
    raw = encoder.encode(EVENT)
    assert raw[0] == 0
    assert struct.unpack(">I", raw[1:5])[0] == 3
    assert decoder.decode(raw) == EVENT


@given(
    event_id=st.text(min_size=1, max_size=40),
    amount=st.floats(min_value=0, max_value=1e9),
    hour=st.integers(0, 23),
    online=st.booleans(),
    at=st.integers(0, 2**62),
)
def test_round_trip_of_any_transaction(event_id, amount, hour, online, at):
    codec = AvroEncoder(LocalCatalogue(), "transaction.avsc", "t-value")
    event = {**EVENT, "event_id": event_id, "amount": amount, "hour_of_day": hour,
             "is_online": online, "event_time_ms": at}  # fmt: skip
    assert AvroDecoder(LocalCatalogue(), "transaction.avsc").decode(codec.encode(event)) == event


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (None, "truncated"),
        (b"", "truncated"),
        (b"\x00\x00\x00", "truncated"),
        (b"\x01\x00\x00\x00\x01abc", "bad_magic"),
        (b"\x00\x00\x00\x00\x63abc", "unknown_schema"),
    ],
)
def test_unreadable_framing(decoder, raw, reason):
    with pytest.raises(DecodeError) as caught:
        decoder.decode(raw)
    assert caught.value.reason == reason


def test_truncated_body(encoder, decoder):
    raw = encoder.encode(EVENT)
    with pytest.raises(DecodeError) as caught:
        decoder.decode(raw[:-5])
    assert caught.value.reason == "truncated"
    assert "ended early" in str(caught.value)


def test_trailing_bytes_mean_the_wrong_schema(encoder, decoder):
    with pytest.raises(DecodeError) as caught:
        decoder.decode(encoder.encode(EVENT) + b"\x00\x01")
    assert caught.value.reason == "trailing_bytes"


def test_record_of_another_schema_is_rejected(decoder):
    prediction_framed = b"\x00" + struct.pack(">I", 4) + b"\x02a"
    with pytest.raises(DecodeError) as caught:
        decoder.decode(prediction_framed)
    assert caught.value.reason in {"incompatible_schema", "truncated", "corrupt"}


def test_unknown_id_names_where_it_looked(decoder):
    with pytest.raises(SchemaNotFoundError, match="local catalogue") as caught:
        decoder.decode(b"\x00" + struct.pack(">I", 4242) + b"\x00")
    assert caught.value.schema_id == 4242


def test_local_catalogue_ids_are_stable():
    assert LOCAL_IDS == {
        1: "history/transaction-1.avsc",
        2: "history/prediction-1.avsc",
        3: "transaction.avsc",
        4: "prediction.avsc",
    }


def test_events_written_with_the_first_schema_still_decode(decoder):
    first = AvroEncoder(LocalCatalogue(), "history/transaction-1.avsc", "t-value")
    before_priorities = {k: v for k, v in EVENT.items() if k != "priority"}
    framed = first.encode(before_priorities)
    assert framed[1:5] == struct.pack(">I", 1)
    assert decoder.decode(framed) == EVENT


def test_a_schema_the_catalogue_does_not_ship_gets_the_same_computed_id_everywhere():
    schema = {"type": "record", "name": "Click", "fields": [{"name": "page", "type": "string"}]}
    first = AvroEncoder(LocalCatalogue(), schema, "clicks-value")
    again = LocalCatalogue().id_for("other-subject", schema)
    assert first.schema_id == again > max(LOCAL_IDS)
    # A consumer that knows the schema decodes what was framed with that id.
    decoded = AvroDecoder(LocalCatalogue(known=[schema]), schema).decode(
        first.encode({"page": "a"})
    )
    assert decoded == {"page": "a"}


def test_unknown_ids_are_learned_once_and_then_decode(encoder):
    decoder = AvroDecoder(LocalCatalogue(), "transaction.avsc")
    framed = encoder.encode(EVENT)
    assert decoder.unknown_ids([framed, b"junk"]) == {3}
    decoder.learn({3, 4242})
    assert decoder.unknown_ids([framed]) == set()
    with pytest.raises(SchemaNotFoundError):
        decoder.decode(b"\x00" + struct.pack(">I", 4242) + b"\x00")


def test_a_shipped_schema_changed_by_one_caller_is_unchanged_for_the_next():
    mine = load_schema("transaction.avsc")
    mine["fields"].clear()
    assert [f["name"] for f in load_schema("transaction.avsc")["fields"]][:2] == [
        "event_id", "user_id",
    ]  # fmt: skip


def test_an_id_the_registry_does_not_know_is_asked_for_once():
    """A reader of many records framed with such an id (the read-back after a restart,
    the audit) asked the registry again for each: a round trip per record."""
    asked = []

    class Registry:
        def schema_for_id(self, schema_id):
            asked.append(schema_id)
            raise SchemaNotFoundError(schema_id, "the registry")

    decoder = AvroDecoder(Registry(), None)
    framed = struct.pack(">bI", 0, 99) + b"\x00"
    for _ in range(50):
        with pytest.raises(SchemaNotFoundError):
            decoder.decode(framed)
    assert asked == [99]
