"""Signing and checking what pods publish in Redis: pod records and KV event batches.

Whoever can write to Redis could otherwise register a pod of their own (a record claiming an
empty queue draws every request) or fill the router's prefix index with another pod's
blocks. Every pod of a service holds the service's KV transfer key, so it signs what it
publishes; a router given the key ignores whatever does not verify.

The MAC is HMAC-SHA256 with the key (`TransferKey.mac`) over the msgpack encoding of a
domain tag and every field in a fixed order and type, so the JSON or stream round trip
cannot change what is signed, and a MAC made for a record never verifies as a batch.

Values are checked too, key or not: a record's numbers feed the routing policies, so a
negative queue or a usage above 1 would pull every request towards one pod.
"""

from __future__ import annotations

import enum
import math
from dataclasses import replace
from urllib.parse import urlsplit

from kvferry.kvtransfer.auth import TransferKey
from kvferry.protocol.kv_events import KVEventBatch
from kvferry.protocol.registry import PodRecord

_RECORD_TAG = b"kvferry-pod-record/v1"
_EVENTS_TAG = b"kvferry-kv-events/v1"
# What a record's `encoder_input` may be: decoder-only, a token encoder, an audio encoder.
ENCODER_INPUTS = ("", "tokens", "audio")
# Seconds a record's `updated_at` may lie ahead of the reader's clock (clocks of different
# machines differ a little; a record stamped far ahead is made up).
MAX_FUTURE_S = 60.0


class Rejection(str, enum.Enum):
    """Why a reader ignored a record or a KV event batch (a metric label)."""

    MALFORMED = "malformed"  # not a record or batch at all, or filed under another pod's key
    UNSIGNED = "unsigned"  # no MAC, and the reader has the key
    BAD_SIGNATURE = "bad_signature"  # a MAC that this service's key did not make
    OUT_OF_RANGE = "out_of_range"  # a value no pod publishes (see `record_out_of_range`)


# ---------------------------------------------------------------------------- pod records
def _record_fields(record: PodRecord) -> tuple[object, ...]:
    """Every field of the record but its MAC, each in the type it is published with.
    `is_leaving` is signed only when set, and the encoder fields only for an
    encoder-decoder model, so a live decoder-only pod's MAC is what it was before those
    fields existed (routers and pods of either version verify each other's live records)."""
    fields: tuple[object, ...] = (
        _RECORD_TAG, record.pod, record.service, record.role, record.model, record.url,
        int(record.block_size), int(record.num_running), int(record.num_waiting),
        float(record.kv_cache_usage), float(record.updated_at),
        int(record.max_model_len), int(record.max_token_chars))
    if record.encoder_input:
        fields = (*fields, "encoder", record.encoder_input, int(record.max_encoder_len))
    return (*fields, "is_leaving") if record.is_leaving else fields


def sign_record(record: PodRecord, key: TransferKey) -> PodRecord:
    """`record` with its MAC."""
    return replace(record, mac=key.mac(*_record_fields(record)))


def record_out_of_range(record: PodRecord, now: float) -> str | None:
    """What is out of range in the record (a message naming the field), or None.

    Types first: JSON gives any value to any field, and `True` is an int to Python.
    """
    for name in ("pod", "service", "role", "model", "url", "encoder_input"):
        if not isinstance(getattr(record, name), str):
            return f"{name} is not a string"
    for name in ("block_size", "num_running", "num_waiting", "max_model_len", "max_token_chars",
                 "max_encoder_len"):
        value = getattr(record, name)
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name} is not an integer"
    for name in ("kv_cache_usage", "updated_at"):
        value = getattr(record, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) \
                or not math.isfinite(value):
            return f"{name} is not a finite number"
    if record.mac is not None and not isinstance(record.mac, str):
        return "mac is not a string"
    if not isinstance(record.is_leaving, bool):
        return "is_leaving is not a boolean"
    return _range_problem(record, now)


def _range_problem(record: PodRecord, now: float) -> str | None:
    if record.block_size <= 0:
        return f"block_size {record.block_size} <= 0"
    if record.encoder_input not in ENCODER_INPUTS:
        return f"encoder_input {record.encoder_input!r} is none of {ENCODER_INPUTS}"
    if (record.max_encoder_len > 0) != bool(record.encoder_input) or record.max_encoder_len < 0:
        return f"max_encoder_len {record.max_encoder_len} with encoder_input " \
               f"{record.encoder_input!r} (> 0 exactly for an encoder-decoder model)"
    if record.max_model_len < 0 or record.max_token_chars < 0:
        return f"negative length limits ({record.max_model_len} max_model_len, " \
               f"{record.max_token_chars} max_token_chars)"
    if record.num_running < 0 or record.num_waiting < 0:
        return f"negative request counts ({record.num_running} running, " \
               f"{record.num_waiting} waiting)"
    if not 0.0 <= record.kv_cache_usage <= 1.0:
        return f"kv_cache_usage {record.kv_cache_usage} outside [0, 1]"
    url = urlsplit(record.url)
    if url.scheme not in ("http", "https") or not url.hostname:
        return "url is not an http(s) address"
    if record.updated_at > now + MAX_FUTURE_S:
        return f"updated_at {record.updated_at - now:.0f} s in the future"
    return None


def check_record(record: PodRecord, key: TransferKey | None, now: float) -> Rejection | None:
    """None when the router may use the record; else why not.

    Without a key (an insecure setup) a record needs no MAC, but its values must still be
    in range. The range check runs first: a MAC is only compared for well-typed fields.
    """
    if record_out_of_range(record, now) is not None:
        return Rejection.OUT_OF_RANGE
    if key is None:
        return None
    if record.mac is None:
        return Rejection.UNSIGNED
    if not key.verifies(record.mac, *_record_fields(record)):
        return Rejection.BAD_SIGNATURE
    return None


# ---------------------------------------------------------------------------- KV events
def _batch_fields(batch: KVEventBatch) -> tuple[object, ...]:
    """The batch as it travels: pod, instance and the concatenated hash lists. The
    cross-attention lists are signed only when the batch has some, so a decoder-only
    pod's batches are signed as before they existed."""
    fields: tuple[object, ...] = (_EVENTS_TAG, batch.pod, batch.instance or b"",
                                  b"".join(batch.evicted), b"".join(batch.stored))
    if batch.cross_evicted or batch.cross_stored:
        fields = (*fields, "cross", b"".join(batch.cross_evicted),
                  b"".join(batch.cross_stored))
    return fields


def sign_batch(batch: KVEventBatch, key: TransferKey) -> KVEventBatch:
    """`batch` with its MAC."""
    return replace(batch, mac=key.mac(*_batch_fields(batch)))


def check_batch(batch: KVEventBatch, key: TransferKey | None) -> Rejection | None:
    """None when the router may apply the batch (any batch without a key); else why not."""
    if key is None:
        return None
    if batch.mac is None:
        return Rejection.UNSIGNED
    if not key.verifies(batch.mac, *_batch_fields(batch)):
        return Rejection.BAD_SIGNATURE
    return None
