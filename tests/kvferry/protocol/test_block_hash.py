"""Chained block hashes: equal hashes mean equal prefixes."""

import hashlib

import numpy as np

from kvferry.protocol.block_hash import ROOT_HASH, hash_block_tokens, hash_request_blocks

BLOCK_SIZE = 4


def make_tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_block_hash_is_sha256_of_parent_and_int64_tokens() -> None:
    expected = hashlib.sha256(ROOT_HASH + np.array([1, 2, 3, 4], dtype=np.int64).tobytes())
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]) == expected.digest()
    assert len(hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])) == 32


def test_list_and_array_token_ids_hash_alike() -> None:
    as_list = hash_block_tokens(ROOT_HASH, [5, 6, 7, 8])
    as_array = hash_block_tokens(ROOT_HASH, np.array([5, 6, 7, 8], dtype=np.int32))
    assert as_list == as_array


def test_only_full_blocks_are_hashed() -> None:
    assert hash_request_blocks(make_tokens(3), BLOCK_SIZE, []) == []
    assert len(hash_request_blocks(make_tokens(4), BLOCK_SIZE, [])) == 1
    assert len(hash_request_blocks(make_tokens(11), BLOCK_SIZE, [])) == 2
    assert len(hash_request_blocks(make_tokens(12), BLOCK_SIZE, [])) == 3


def test_hashes_chain_from_the_root() -> None:
    tokens = make_tokens(8)
    first = hash_block_tokens(ROOT_HASH, tokens[:4])
    second = hash_block_tokens(first, tokens[4:8])
    assert hash_request_blocks(tokens, BLOCK_SIZE, []) == [first, second]


def test_same_prefix_gives_same_hashes() -> None:
    a = hash_request_blocks(make_tokens(8) + [1, 2, 3, 4], BLOCK_SIZE, [])
    b = hash_request_blocks(make_tokens(8) + [9, 9, 9, 9, 9], BLOCK_SIZE, [])
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_a_different_earlier_block_changes_every_later_hash() -> None:
    tokens = make_tokens(16)
    changed = list(tokens)
    changed[1] = 0  # inside block 0
    a = hash_request_blocks(tokens, BLOCK_SIZE, [])
    b = hash_request_blocks(changed, BLOCK_SIZE, [])
    assert [x != y for x, y in zip(a, b)] == [True, True, True, True]
    # Blocks 1..3 hold identical tokens; only the chain differs.
    assert tokens[4:] == changed[4:]


def test_extra_keys_change_every_hash() -> None:
    tokens = make_tokens(8)
    plain = hash_request_blocks(tokens, BLOCK_SIZE, [])
    salted = hash_request_blocks(tokens, BLOCK_SIZE, [], extra_keys=b"salt-a")
    other = hash_request_blocks(tokens, BLOCK_SIZE, [], extra_keys=b"salt-b")
    again = hash_request_blocks(tokens, BLOCK_SIZE, [], extra_keys=b"salt-a")
    assert [p != s for p, s in zip(plain, salted)] == [True, True]
    assert [s != o for s, o in zip(salted, other)] == [True, True]
    assert salted == again


def test_known_hashes_are_extended_in_place_not_recomputed() -> None:
    tokens = make_tokens(12)
    known = hash_request_blocks(tokens[:5], BLOCK_SIZE, [])
    assert len(known) == 1
    marker = b"\x01" * 32
    known[0] = marker  # a stale first hash proves it is reused as the parent
    result = hash_request_blocks(tokens, BLOCK_SIZE, known)
    assert result is known
    assert known[0] == marker
    assert known[1] == hash_block_tokens(marker, tokens[4:8])
    assert known[2] == hash_block_tokens(known[1], tokens[8:12])


def test_incremental_hashing_matches_hashing_at_once() -> None:
    tokens = make_tokens(20)
    known: list[bytes] = []
    for end in [0, 3, 6, 9, 12, 15, 18, 20]:
        hash_request_blocks(tokens[:end], BLOCK_SIZE, known)
    assert known == hash_request_blocks(tokens, BLOCK_SIZE, [])
    assert len(known) == 5
