"""`kv_transfer_params`: what a request carries between the prefill and decode hops.

The shape is vLLM's, so the proxies that drive vLLM's disaggregation (vLLM's examples,
llm-d's routing sidecar, vllm-router's P/D mode) drive kvferry pods unchanged:

- to a prefill pod: `{"do_remote_decode": true}`: compute the prompt, hold its blocks;
- back from it: `{"do_remote_prefill": true, "remote_engine_id", "remote_host",
  "remote_port", "remote_block_ids", "remote_request_id"}` plus kvferry's own fields;
- to a decode pod: that object unchanged: pull the blocks, then decode.

Fields kvferry adds are prefixed `kvferry_`; unknown vLLM fields are ignored (newer vLLM
versions add some), unknown `kvferry_` fields are refused (a typo must not pass silently).
`remote_block_ids` is a flat list for the one group of a decoder-only model (vLLM's form)
or a list of lists, one per block group (group 1: an encoder-decoder's cross-attention).

An encoder pod (encoder-decoder models) holds only a request's cross-attention blocks: its
params have an empty group 0, the cross blocks as group 1, `kvferry_num_tokens` 0, and say
which encoder input they hold (`kvferry_encoder_hash`, the hex of the input's key, and
`kvferry_num_encoder_tokens`), so a decode pod pulls them only for the same input. A prefill
pod's hold of an encoder-decoder request (a long decoder prompt) names both groups: the
decoder prompt's blocks as group 0 (`kvferry_num_tokens` of them), the cross blocks as group
1, and the same encoder fields. Such a prefill pod is sent the encoder pod's params with
`do_remote_decode` added: it pulls the cross blocks, computes the decoder prompt, then holds
both groups.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Version of kvferry's transfer protocol (side channel messages, notifications, fields).
TRANSFER_PROTOCOL_VERSION = 2

# Per block group, the block ids in table order.
BlockIdGroups = tuple[tuple[int, ...], ...]

_KVFERRY_FIELDS = frozenset(
    {"kvferry_agent_name", "kvferry_num_tokens", "kvferry_lease_s", "kvferry_protocol_version",
     "kvferry_prompt_hash", "kvferry_expires_at", "kvferry_mac", "kvferry_encoder_hash",
     "kvferry_num_encoder_tokens"}
)
_REMOTE_FIELDS = (
    "remote_engine_id", "remote_host", "remote_port", "remote_block_ids", "remote_request_id"
)


@dataclass(frozen=True)
class KVTransferParams:
    """One request's transfer instructions, parsed and validated."""

    # On a prefill pod: hold the prompt's blocks for a remote decode and return params.
    do_remote_decode: bool = False
    # On a decode pod: the prompt's KV is on a remote producer; pull it.
    do_remote_prefill: bool = False
    # The producer's engine id; a new id at the same address means it restarted.
    remote_engine_id: str | None = None
    # The producer's side channel.
    remote_host: str | None = None
    remote_port: int | None = None
    # The producer's block ids per group, covering its computed prompt tokens.
    remote_block_ids: BlockIdGroups = ()
    # The request id the producer holds the blocks under.
    remote_request_id: str | None = None
    # The producer's NIXL agent: changes whenever the producer process restarts, even
    # under the same engine id, so a consumer knows its cached handshake is stale.
    kvferry_agent_name: str | None = None
    # Prompt tokens whose KV the producer computed (the blocks hold that many tokens).
    kvferry_num_tokens: int | None = None
    # Seconds the producer holds the blocks without a heartbeat.
    kvferry_lease_s: float | None = None
    kvferry_protocol_version: int = TRANSFER_PROTOCOL_VERSION
    # Hash of the prompt tokens whose KV the blocks hold (prompt_hash): a consumer whose
    # prompt differs must not take KV computed for another prompt.
    kvferry_prompt_hash: str | None = None
    # Unix time after which a consumer refuses the params (the producer freed the blocks).
    kvferry_expires_at: int | None = None
    # HMAC-SHA256 (hex) of every other field with the service's transfer key (auth.py): a
    # consumer dials nothing the params name unless it verifies.
    kvferry_mac: str | None = None
    # An encoder pod's hold: the key (hex) of the encoder input whose cross-attention KV
    # the blocks of group 1 hold, and its encoder positions.
    kvferry_encoder_hash: str | None = None
    kvferry_num_encoder_tokens: int | None = None

    @property
    def is_cross_pull(self) -> bool:
        """Params of an encoder-decoder request's hold: pull the cross-attention blocks
        (group 1), and the decoder prompt's (group 0) when a prefill pod computed it."""
        return self.do_remote_prefill and self.kvferry_encoder_hash is not None

    def without_pull(self) -> KVTransferParams | None:
        """What is left once the pull is over (done, failed or not taken): the instruction
        to hold what this engine computes for a remote decode, if there was one."""
        return KVTransferParams(do_remote_decode=True) if self.do_remote_decode else None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> KVTransferParams | None:
        """Parses a request's `kv_transfer_params`; None or {} gives None.

        Raises ValueError naming the offending field.
        """
        if data is None:
            return None
        if not isinstance(data, Mapping):
            raise ValueError(f"kv_transfer_params must be an object, got {type(data).__name__}")
        if not data:
            return None
        _refuse_unknown_kvferry_fields(data)
        params = cls(
            do_remote_decode=_bool(data, "do_remote_decode"),
            do_remote_prefill=_bool(data, "do_remote_prefill"),
            remote_engine_id=_optional_str(data, "remote_engine_id"),
            remote_host=_optional_str(data, "remote_host"),
            remote_port=_optional_port(data, "remote_port"),
            remote_block_ids=_block_id_groups(data.get("remote_block_ids")),
            remote_request_id=_optional_str(data, "remote_request_id"),
            kvferry_agent_name=_optional_str(data, "kvferry_agent_name"),
            kvferry_num_tokens=_optional_count(data, "kvferry_num_tokens", minimum=0),
            kvferry_lease_s=_optional_seconds(data, "kvferry_lease_s"),
            kvferry_protocol_version=_protocol_version(data),
            kvferry_prompt_hash=_optional_str(data, "kvferry_prompt_hash"),
            kvferry_expires_at=_optional_count(data, "kvferry_expires_at"),
            kvferry_mac=_optional_str(data, "kvferry_mac"),
            kvferry_encoder_hash=_optional_str(data, "kvferry_encoder_hash"),
            kvferry_num_encoder_tokens=_optional_count(data, "kvferry_num_encoder_tokens"),
        )
        params.check_remote_prefill()
        return params

    def check_remote_prefill(self) -> None:
        """A remote prefill needs every remote field; raises ValueError naming the first missing."""
        if not self.do_remote_prefill:
            return
        for name in _REMOTE_FIELDS:
            if not getattr(self, name):
                raise ValueError(f"kv_transfer_params.{name} is required with do_remote_prefill")
        if self.kvferry_num_tokens == 0 and not self.is_cross_pull:
            raise ValueError("kv_transfer_params.kvferry_num_tokens must be >= 1 (0 only for "
                             "an encoder pod's hold, with kvferry_encoder_hash)")
        if self.is_cross_pull:
            groups = self.remote_block_ids
            if len(groups) != 2 or not groups[1]:
                raise ValueError("kv_transfer_params with kvferry_encoder_hash need "
                                 "remote_block_ids [[decoder block ids...], [cross-attention "
                                 "block ids...]]")
            if bool(groups[0]) != bool(self.kvferry_num_tokens):
                raise ValueError("kv_transfer_params.remote_block_ids[0] must be empty exactly "
                                 "when kvferry_num_tokens is 0 (an encoder pod's hold)")
            if not self.kvferry_num_encoder_tokens:
                raise ValueError("kv_transfer_params.kvferry_num_encoder_tokens is required "
                                 "with kvferry_encoder_hash")
            return
        for i, group in enumerate(self.remote_block_ids):
            if not group:
                raise ValueError(f"kv_transfer_params.remote_block_ids[{i}] is empty")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form returned to the client; one group is written as vLLM's flat list."""
        groups = [list(g) for g in self.remote_block_ids]
        out: dict[str, Any] = {
            "do_remote_decode": self.do_remote_decode,
            "do_remote_prefill": self.do_remote_prefill,
            "remote_engine_id": self.remote_engine_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_block_ids": groups[0] if len(groups) == 1 else groups,
            "remote_request_id": self.remote_request_id,
            "kvferry_agent_name": self.kvferry_agent_name,
            "kvferry_num_tokens": self.kvferry_num_tokens,
            "kvferry_lease_s": self.kvferry_lease_s,
            "kvferry_protocol_version": self.kvferry_protocol_version,
            "kvferry_prompt_hash": self.kvferry_prompt_hash,
            "kvferry_expires_at": self.kvferry_expires_at,
            "kvferry_mac": self.kvferry_mac,
            "kvferry_encoder_hash": self.kvferry_encoder_hash,
            "kvferry_num_encoder_tokens": self.kvferry_num_encoder_tokens,
        }
        return {k: v for k, v in out.items() if v is not None}


def prompt_hash(token_ids: Sequence[int], cache_salt: bytes | None = None) -> str:
    """A short digest of token ids, the same on every engine.

    `cache_salt`: the prompt's extra key (the hash of a prompt given as embeddings, whose
    token ids are placeholders), so that KV computed for other embeddings never matches.
    """
    digest = hashlib.sha256(b",".join(str(t).encode() for t in token_ids))
    if cache_salt:
        digest.update(b"|salt|" + cache_salt)
    return digest.hexdigest()[:32]


def _refuse_unknown_kvferry_fields(data: Mapping[str, Any]) -> None:
    for key in data:
        if isinstance(key, str) and key.startswith("kvferry_") and key not in _KVFERRY_FIELDS:
            raise ValueError(
                f"kv_transfer_params.{key} is not a kvferry field "
                f"(known: {', '.join(sorted(_KVFERRY_FIELDS))})"
            )


def _bool(data: Mapping[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"kv_transfer_params.{name} must be a boolean, got {value!r}")
    return value


def _optional_str(data: Mapping[str, Any], name: str) -> str | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"kv_transfer_params.{name} must be a non-empty string, got {value!r}")
    return value


def _is_int(value: Any) -> bool:
    # bool is an int subclass; `true` is never a port or a block id.
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_port(data: Mapping[str, Any], name: str) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if not _is_int(value) or not 1 <= value <= 65535:
        raise ValueError(
            f"kv_transfer_params.{name} must be an integer in [1, 65535], got {value!r}"
        )
    return value


def _optional_count(data: Mapping[str, Any], name: str, minimum: int = 1) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < minimum:
        raise ValueError(f"kv_transfer_params.{name} must be an integer >= {minimum}, got "
                         f"{value!r}")
    return value


def _optional_seconds(data: Mapping[str, Any], name: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"kv_transfer_params.{name} must be a number > 0, got {value!r}")
    return float(value)


def _protocol_version(data: Mapping[str, Any]) -> int:
    value = data.get("kvferry_protocol_version", TRANSFER_PROTOCOL_VERSION)
    if value != TRANSFER_PROTOCOL_VERSION or not _is_int(value):
        raise ValueError(
            f"kv_transfer_params.kvferry_protocol_version is {value!r}; this engine speaks "
            f"version {TRANSFER_PROTOCOL_VERSION}"
        )
    return value


def _block_ids(values: Any, where: str) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{where} must be a list of block ids, got {values!r}")
    for block_id in values:
        # Block 0 is the null block on every engine: it never holds a request's KV.
        if not _is_int(block_id) or block_id < 1:
            raise ValueError(f"{where} must hold integers >= 1, got {block_id!r}")
    return tuple(values)


def _block_id_groups(value: Any) -> BlockIdGroups:
    where = "kv_transfer_params.remote_block_ids"
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where} must be a list, got {value!r}")
    if not value:
        return ()
    if all(isinstance(v, (list, tuple)) for v in value):
        return tuple(_block_ids(g, f"{where}[{i}]") for i, g in enumerate(value))
    return (_block_ids(value, where),)
