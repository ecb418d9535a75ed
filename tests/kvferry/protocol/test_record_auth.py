"""Pod records and KV event batches: signed by a pod, verified by a router, through the
same encodings they travel in (JSON in a key, fields of a stream entry)."""

from __future__ import annotations

import pytest
from kvferry.kvtransfer.auth import TransferKey

from kvferry.protocol.kv_events import KVEventBatch
from kvferry.protocol.record_auth import (
    MAX_FUTURE_S,
    Rejection,
    check_batch,
    check_record,
    sign_batch,
    sign_record,
)
from kvferry.protocol.registry import PodRecord

KEY = TransferKey(b"k" * 32)
OTHER = TransferKey(b"o" * 32)
NOW = 1_800_000_000.0


def record(**changes: object) -> PodRecord:
    fields: dict[str, object] = {
        "pod": "pod-a", "service": "svc", "role": "decode", "model": "m", "url": "http://10.0.0.7:8000",
        "block_size": 16, "num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "updated_at": NOW}
    return PodRecord(**{**fields, **changes})  # type: ignore[arg-type]


def stored(rec: PodRecord) -> PodRecord:
    """The record as a router reads it back from Redis."""
    return PodRecord.from_json(rec.to_json())


def test_a_signed_record_verifies_after_its_json_round_trip() -> None:
    signed = sign_record(record(kv_cache_usage=0.0), KEY)
    assert signed.mac is not None and len(signed.mac) == 64
    assert check_record(stored(signed), KEY, NOW) is None


@pytest.mark.parametrize("field,value", [
    ("pod", "pod-b"), ("url", "http://10.0.0.8:8000"), ("num_waiting", 0),
    ("kv_cache_usage", 0.5), ("updated_at", NOW + 1), ("role", "prefill"),
    ("max_model_len", 1), ("max_token_chars", 99), ("is_leaving", True)])
def test_changing_any_field_breaks_the_mac(field: str, value: object) -> None:
    signed = stored(sign_record(record(), KEY))
    changed = PodRecord(**{**signed.__dict__, field: value})
    assert check_record(changed, KEY, NOW) is Rejection.BAD_SIGNATURE


def test_unsigned_and_foreign_records_are_refused_only_with_a_key() -> None:
    assert check_record(stored(record()), KEY, NOW) is Rejection.UNSIGNED
    assert check_record(stored(sign_record(record(), OTHER)), KEY, NOW) is Rejection.BAD_SIGNATURE
    assert check_record(stored(record()), None, NOW) is None
    assert '"mac"' not in record().to_json()


@pytest.mark.parametrize("changes", [
    {"num_waiting": -1000}, {"num_running": -1}, {"kv_cache_usage": -0.1},
    {"kv_cache_usage": 1.01}, {"kv_cache_usage": float("nan")}, {"block_size": 0},
    {"url": "ftp://10.0.0.7/"}, {"url": "http://"}, {"updated_at": NOW + MAX_FUTURE_S + 1},
    {"num_waiting": True}, {"num_running": "1"}, {"pod": 7}, {"is_leaving": 1},
    {"is_leaving": "yes"}, {"encoder_input": "video", "max_encoder_len": 10},
    {"encoder_input": "tokens"}, {"max_encoder_len": 1500},
    {"encoder_input": "audio", "max_encoder_len": -1}, {"encoder_input": 1},
    {"encoder_input": "tokens", "max_encoder_len": 1.5}])
def test_out_of_range_records_are_refused_with_a_key_or_without(
        changes: dict[str, object]) -> None:
    for key in (KEY, None):
        assert check_record(record(**changes), key, NOW) is Rejection.OUT_OF_RANGE
    # Signed or not: a MAC does not make a value possible.
    assert check_record(record(**changes), KEY, NOW) is Rejection.OUT_OF_RANGE


def test_a_live_record_and_its_mac_read_as_before_the_leaving_flag() -> None:
    """A live pod's record has no `is_leaving` in its JSON nor in its MAC, so routers and
    pods from before the flag verify each other's live records; a leaving record's MAC
    covers the flag, and it survives the JSON round trip."""
    live = sign_record(record(), KEY)
    assert "is_leaving" not in live.to_json()
    assert live.mac == KEY.mac(b"kvferry-pod-record/v1", "pod-a", "svc", "decode", "m",
                               "http://10.0.0.7:8000", 16, 2, 1, 0.25, NOW, 0, 0)
    leaving = stored(sign_record(record(is_leaving=True), KEY))
    assert leaving.is_leaving and check_record(leaving, KEY, NOW) is None
    assert check_record(PodRecord(**{**leaving.__dict__, "is_leaving": False}), KEY,
                        NOW) is Rejection.BAD_SIGNATURE


def test_an_encoder_decoder_record_carries_its_encoder_signed() -> None:
    """The encoder fields travel in the JSON and the MAC of an encoder-decoder pod's record
    only; a decoder-only record and its MAC read as before they existed, and a record
    written before them parses as decoder-only."""
    whisper = stored(sign_record(record(encoder_input="audio", max_encoder_len=1500), KEY))
    assert (whisper.encoder_input, whisper.max_encoder_len) == ("audio", 1500)
    assert whisper.is_encoder_decoder and check_record(whisper, KEY, NOW) is None
    assert whisper.mac == KEY.mac(b"kvferry-pod-record/v1", "pod-a", "svc", "decode", "m",
                                  "http://10.0.0.7:8000", 16, 2, 1, 0.25, NOW, 0, 0,
                                  "encoder", "audio", 1500)
    for field, value in (("encoder_input", "tokens"), ("max_encoder_len", 1024)):
        changed = PodRecord(**{**whisper.__dict__, field: value})
        assert check_record(changed, KEY, NOW) is Rejection.BAD_SIGNATURE
    plain = sign_record(record(), KEY)
    assert "encoder" not in plain.to_json() and not stored(plain).is_encoder_decoder
    old_json = ('{"pod":"pod-a","service":"svc","role":"decode","model":"m",'
                '"url":"http://10.0.0.7:8000","block_size":16,"num_running":2,'
                '"num_waiting":1,"kv_cache_usage":0.25,"updated_at":1800000000.0}')
    assert PodRecord.from_json(old_json) == record()


def test_a_record_of_integral_floats_verifies_as_signed() -> None:
    # JSON writes 1.0 as 1.0, but a writer may give 1: the MAC covers the value, not its type.
    signed = sign_record(record(kv_cache_usage=1.0, updated_at=NOW), KEY)
    as_ints = PodRecord(**{**signed.__dict__, "kv_cache_usage": 1, "updated_at": int(NOW)})
    assert check_record(as_ints, KEY, NOW) is None


def batch() -> KVEventBatch:
    return KVEventBatch("pod-a", b"instance-1", [b"e" * 32], [b"s" * 32, b"t" * 32])


def read_back(b: KVEventBatch) -> KVEventBatch:
    """The batch as XREAD returns its fields (bytes keys and values)."""
    fields = {k.encode(): v if isinstance(v, bytes) else v.encode()
              for k, v in b.to_fields().items()}
    return KVEventBatch.from_fields(fields)


def test_a_signed_batch_verifies_after_the_stream_round_trip() -> None:
    assert check_batch(read_back(sign_batch(batch(), KEY)), KEY) is None


def test_forged_batches_are_refused_with_a_key() -> None:
    assert check_batch(read_back(batch()), KEY) is Rejection.UNSIGNED
    assert check_batch(read_back(sign_batch(batch(), OTHER)), KEY) is Rejection.BAD_SIGNATURE
    moved = read_back(sign_batch(batch(), KEY))
    moved = KVEventBatch("pod-b", moved.instance, moved.evicted, moved.stored, moved.mac)
    assert check_batch(moved, KEY) is Rejection.BAD_SIGNATURE
    assert check_batch(read_back(batch()), None) is None


def test_cross_block_hashes_travel_apart_from_decoder_blocks_and_are_signed() -> None:
    cross = KVEventBatch("pod-a", b"instance-1", [b"e" * 32], [b"s" * 32], None,
                         cross_evicted=[b"x" * 32], cross_stored=[b"y" * 32, b"z" * 32])
    fields = cross.to_fields()
    assert (fields["cross_evicted"], fields["cross_stored"]) == (b"x" * 32, b"y" * 32 + b"z" * 32)
    back = read_back(sign_batch(cross, KEY))
    assert (back.evicted, back.stored) == ([b"e" * 32], [b"s" * 32])
    assert (back.cross_evicted, back.cross_stored) == ([b"x" * 32], [b"y" * 32, b"z" * 32])
    assert check_batch(back, KEY) is None
    # The MAC covers the cross lists: moving a hash between them, or dropping one, breaks it.
    for changes in ({"cross_stored": [b"y" * 32]}, {"cross_evicted": [], "cross_stored":
                                                     [b"x" * 32, b"y" * 32, b"z" * 32]}):
        assert check_batch(KVEventBatch(**{**back.__dict__, **changes}), KEY) \
            is Rejection.BAD_SIGNATURE
    # A batch without cross hashes has no cross fields and is signed as before them.
    plain = sign_batch(batch(), KEY)
    assert "cross_stored" not in plain.to_fields()
    assert plain.mac == KEY.mac(b"kvferry-kv-events/v1", "pod-a", b"instance-1", b"e" * 32,
                                b"s" * 32 + b"t" * 32)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        KVEventBatch.from_fields({b"pod": b"pod-a", b"cross_stored": b"y" * 31})


def test_a_record_mac_is_no_batch_mac() -> None:
    signed = sign_record(record(), KEY)
    forged = KVEventBatch("pod-a", None, [], [], signed.mac)
    assert check_batch(forged, KEY) is Rejection.BAD_SIGNATURE
