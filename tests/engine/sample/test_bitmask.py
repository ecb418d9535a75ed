"""Token bitmasks (one bit per token id, int32 words, lowest bit first) applied to logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvferry.engine.sample.bitmask import apply_token_bitmask, unpack_bitmask


def pack(allowed: np.ndarray) -> torch.Tensor:
    """The reference packing: token t is bit t % 32 of word t // 32."""
    num_rows, vocab = allowed.shape
    words = np.zeros((num_rows, (vocab + 31) // 32), dtype=np.uint32)
    for row, token in zip(*np.nonzero(allowed)):
        words[row, token // 32] |= np.uint32(1) << np.uint32(token % 32)
    return torch.from_numpy(words.view(np.int32))


def test_unpack_is_the_inverse_of_packing_for_every_bit_position() -> None:
    rng = np.random.default_rng(0)
    allowed = rng.random((5, 100)) < 0.4
    allowed[0, 31] = allowed[0, 32] = allowed[1, 63] = True  # bit 31: the sign bit of a word
    assert np.array_equal(unpack_bitmask(pack(allowed), 100).numpy(), allowed)


def test_disallowed_tokens_of_the_masked_rows_get_minus_inf_and_nothing_else_changes() -> None:
    logits = torch.randn(4, 70)
    before = logits.clone()
    allowed = np.zeros((2, 70), dtype=bool)
    allowed[0, [3, 40, 69]] = True
    allowed[1, [0]] = True
    out = apply_token_bitmask(logits, torch.tensor([2, 0]), pack(allowed))
    assert torch.equal(logits, before)  # the input is not modified
    assert torch.equal(out[[1, 3]], logits[[1, 3]])  # rows without a grammar are untouched
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [3, 40, 69]
    assert torch.equal(out[2, [3, 40, 69]], logits[2, [3, 40, 69]])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0]
    assert out.argmax(dim=-1)[2].item() in (3, 40, 69)


def test_a_bitmask_for_every_row_in_order_masks_in_one_pass() -> None:
    logits = torch.randn(3, 40)
    allowed = np.random.default_rng(1).random((3, 40)) < 0.5
    whole = apply_token_bitmask(logits, None, pack(allowed))
    by_rows = apply_token_bitmask(logits, torch.tensor([0, 1, 2]), pack(allowed))
    assert torch.equal(whole, by_rows)
    assert np.array_equal(torch.isfinite(whole).numpy(), allowed)


def test_a_bitmask_narrower_than_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="covers 32 tokens, fewer than the vocabulary's 33"):
        unpack_bitmask(torch.zeros(1, 1, dtype=torch.int32), 33)
