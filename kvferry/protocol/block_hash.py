"""Chained block hashes for prefix caching, computed alike by the engines and the router.

The hash of full block `i` covers the hash of block `i - 1`, the block's token ids and the
request's extra keys (a hash of prompt embeddings or of an encoder input), so equal hashes
mean equal prefixes: two requests share block `i` only if everything before it matches too.
"""

from __future__ import annotations

import array
import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

BlockHash = bytes
# sha256 digests.
HASH_BYTES = 32

# The parent of a request's first block.
ROOT_HASH: BlockHash = b"\x00" * HASH_BYTES


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: list[int] | np.ndarray, extra_keys: bytes | None = None
) -> BlockHash:
    """Returns the 32-byte hash of one full block given its parent's hash."""
    digest = hashlib.sha256(parent_hash)
    if hasattr(token_ids, "astype"):  # a NumPy array (the router needs no NumPy import)
        digest.update(token_ids.astype("int64", copy=False).tobytes())
    else:
        digest.update(array.array("q", token_ids).tobytes())  # cheaper than numpy for a block
    if extra_keys:
        digest.update(b"|extra|")
        digest.update(extra_keys)
    return digest.digest()


def hash_request_blocks(
    token_ids: list[int],
    block_size: int,
    known_hashes: list[BlockHash],
    extra_keys: bytes | None = None,
) -> list[BlockHash]:
    """Extends `known_hashes` (in place) with the hashes of every newly full block.

    Equal to chaining `hash_block_tokens` block by block, with the token bytes of all new
    blocks packed at once (this runs for every admitted prompt).
    """
    first, num_full = len(known_hashes), len(token_ids) // block_size
    if num_full <= first:
        return known_hashes
    data = array.array("q", token_ids[first * block_size : num_full * block_size]).tobytes()
    suffix = b"|extra|" + extra_keys if extra_keys else b""
    step = block_size * 8  # bytes of one block's int64 token ids
    parent = known_hashes[-1] if known_hashes else ROOT_HASH
    for offset in range(0, len(data), step):
        parent = hashlib.sha256(parent + data[offset : offset + step] + suffix).digest()
        known_hashes.append(parent)
    return known_hashes


# Domain tags: a cross-attention block's hash is never equal to a decoder block's (those
# hash an int64 token payload after a parent hash, these a tag first).
_ENCODER_INPUT_TAG = b"kvferry-encoder-input|"
_CROSS_BLOCK_TAG = b"kvferry-cross-block|"


def encoder_input_key(kind: str, payload: bytes) -> bytes:
    """The 32-byte key of an encoder input: `kind` ("tokens" or "audio") and its bytes (the
    int64 token ids, or the log-mel features' float32 bytes with their shape first). Equal
    keys mean equal encoder outputs, so requests with equal keys share cross blocks."""
    digest = hashlib.sha256(_ENCODER_INPUT_TAG + kind.encode() + b"|")
    digest.update(payload)
    return digest.digest()


def encoder_token_payload(token_ids: list[int]) -> bytes:
    """The bytes `encoder_input_key` hashes for a token encoder's input."""
    return array.array("q", token_ids).tobytes()


def hash_cross_blocks(encoder_key: bytes, num_blocks: int) -> list[BlockHash]:
    """The hashes of the cross-attention blocks of one encoder input (block `i` holds its
    positions `[i * block_size, (i + 1) * block_size)`; the last may be partial: the input
    never grows, so a partial block is final and cacheable too)."""
    return [hashlib.sha256(_CROSS_BLOCK_TAG + encoder_key + i.to_bytes(4, "little")).digest()
            for i in range(num_blocks)]
