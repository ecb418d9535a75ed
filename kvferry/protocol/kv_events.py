"""The KV event stream: which block hashes each engine started and stopped caching.

One Redis stream per service, `kvferry:<service>:kv_events`. Each entry is one batch from
one engine process: `{pod, instance, evicted, stored}` (and `mac` from a pod with the
service's key: record_auth.py), each hash list being the 32-byte
hashes (`block_hash`) concatenated. An encoder-decoder engine adds `cross_evicted` and
`cross_stored` when it has some: the hashes of cross-attention blocks
(`block_hash.hash_cross_blocks`), kept apart from the decoder's prefix blocks because a
reader uses them apart (a decode pod holding an encoder input's cross blocks needs no
encode hop). `instance` names the engine process that published the
entry; each process's first entry holds no hashes and says that this pod's prefix cache
starts empty (a pod restarted under the same name lost its blocks). A reader applies an
entry's `evicted` before its `stored`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.protocol.block_hash import HASH_BYTES, BlockHash

# The stream keeps about this many batches (a router starting late replays them).
EVENT_STREAM_MAXLEN = 100_000


def kv_events_key(service: str) -> str:
    """The Redis stream of the service's KV events."""
    return f"kvferry:{service}:kv_events"


@dataclass(frozen=True)
class KVEventBatch:
    """One entry of the stream."""

    pod: str  # the pod's registry name
    # The engine process (None from engines that predate instance ids).
    instance: bytes | None
    evicted: list[BlockHash]  # hashes the pod stopped holding, applied first
    stored: list[BlockHash]  # hashes the pod started holding
    # HMAC of the other fields with the service's KV transfer key; None from a pod without.
    mac: str | None = None
    # Cross-attention block hashes the pod stopped / started holding (encoder-decoder
    # models), applied like `evicted` and `stored`.
    cross_evicted: list[BlockHash] = field(default_factory=list)
    cross_stored: list[BlockHash] = field(default_factory=list)

    def to_fields(self) -> dict[str, str | bytes]:
        """The entry as XADD takes it (the cross lists only when the batch has some)."""
        fields: dict[str, str | bytes] = {
            "pod": self.pod, "instance": self.instance or b"",
            "evicted": b"".join(self.evicted), "stored": b"".join(self.stored)}
        if self.cross_evicted or self.cross_stored:
            fields["cross_evicted"] = b"".join(self.cross_evicted)
            fields["cross_stored"] = b"".join(self.cross_stored)
        if self.mac is not None:
            fields["mac"] = self.mac
        return fields

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> KVEventBatch:
        """An entry as XREAD returns it; ValueError when it is not a KV event batch."""
        pod = fields.get(b"pod")
        if not pod:
            raise ValueError("KV event without a pod")
        return cls(pod=pod.decode(errors="replace"), instance=fields.get(b"instance") or None,
                   evicted=split_hashes(fields.get(b"evicted", b"")),
                   stored=split_hashes(fields.get(b"stored", b"")),
                   mac=_text(fields.get(b"mac")),
                   cross_evicted=split_hashes(fields.get(b"cross_evicted", b"")),
                   cross_stored=split_hashes(fields.get(b"cross_stored", b"")))


def split_hashes(joined: bytes) -> list[BlockHash]:
    """The hashes of a concatenated list; ValueError when its length is not whole hashes."""
    if len(joined) % HASH_BYTES:
        raise ValueError(f"KV event hash list of {len(joined)} bytes, not a multiple of "
                         f"{HASH_BYTES}")
    return [joined[i:i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]


def _text(value: bytes | None) -> str | None:
    """A field as text; a MAC that is not ASCII cannot verify, so it reads as a wrong one."""
    return None if value is None else value.decode("ascii", errors="replace")
