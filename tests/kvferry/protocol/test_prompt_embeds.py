"""Decoding a client's prompt embeddings without trusting a byte: each check refuses with a
message that names it, nothing runs code, nothing allocates past the caps; and the salt that
keys an embedding prompt's blocks."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
import torch
from kvferry_testing.embeds import (
    b64,
    code_running_archive,
    code_running_pickle,
    encode,
    huge_sparse,
    out_of_bounds_sparse,
    rss_bytes,
    saved,
    with_member,
)

from kvferry.protocol.prompt_embeds import (
    ARCHIVE_OVERHEAD_BYTES,
    MAX_ARCHIVE_MEMBERS,
    PromptEmbedsError,
    check_archive,
    check_embeds,
    decode_base64,
    decode_prompt_embeds,
    embeds_salt,
    load_tensor,
    max_base64_chars,
    max_payload_bytes,
)

HIDDEN = 16
MAX_ROWS = 32
CAP = max_payload_bytes(MAX_ROWS, HIDDEN)


def decode(text: str) -> torch.Tensor:
    return decode_prompt_embeds(text, HIDDEN, MAX_ROWS, CAP)


def test_caps_follow_the_model() -> None:
    assert CAP == MAX_ROWS * HIDDEN * 8 + ARCHIVE_OVERHEAD_BYTES
    assert max_base64_chars(3) == 4 and max_base64_chars(4) == 8


def test_a_valid_payload_comes_back_as_sent() -> None:
    tensor = torch.randn(5, HIDDEN, dtype=torch.bfloat16)
    out = decode(encode(tensor))
    assert out.dtype == torch.bfloat16 and torch.equal(out, tensor)
    assert torch.equal(decode(encode(tensor.float()[None])), tensor.float())  # squeezed
    assert torch.equal(decode(encode(torch.nn.Parameter(tensor.double()))), tensor.double())
    # A view of a larger tensor is saved with its whole storage; it still loads as the view.
    big = torch.randn(10, HIDDEN)
    assert torch.equal(decode(encode(big[2:7])), big[2:7])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not base64!", "is not valid base64"),
        ("QUJD\nREVG", "is not valid base64"),
        ("QUJ", "is not valid base64"),
        ("é" * 8, "is not valid base64"),
        ("A" * (max_base64_chars(CAP) + 4), f"more than the cap of {max_base64_chars(CAP)}"),
    ],
)
def test_size_and_base64_are_checked_before_anything_parses(text: str, message: str) -> None:
    with pytest.raises(PromptEmbedsError, match=message):
        decode(text)


def test_decoded_bytes_are_capped() -> None:
    # 12 characters may hold 7 bytes (the text's cap) but hold 8.
    assert len(b64(b"12345678")) == max_base64_chars(7) == 12
    with pytest.raises(PromptEmbedsError, match="decodes to 8 bytes, more than the cap of 7"):
        decode_base64(b64(b"12345678"), 7)


def test_only_a_torch_save_archive_of_stored_members_is_read(tmp_path: Path) -> None:
    good = saved(torch.randn(3, HIDDEN))
    cases = [
        (code_running_pickle(tmp_path / "x"), "is not a torch.save archive"),
        (b"PK\x03\x04" + b"\x00" * 64, "is not a readable torch.save archive"),
        (with_member(good, "data.pkl", None, zipfile.ZIP_DEFLATED),
         "archive member 'archive/data.pkl' is compressed"),
    ]
    for payload, message in cases:
        with pytest.raises(PromptEmbedsError, match=message):
            check_archive(payload)
    many = io.BytesIO()
    with zipfile.ZipFile(many, "w") as archive:
        for i in range(MAX_ARCHIVE_MEMBERS + 1):
            archive.writestr(f"m{i}", b"")
    with pytest.raises(PromptEmbedsError, match="65 members, more than the 64"):
        check_archive(many.getvalue())
    check_archive(good)


def test_a_compressed_bomb_is_refused_before_it_is_inflated() -> None:
    """256 MiB of zeros deflate to a few hundred KiB; the loader would inflate them whole."""
    bomb = with_member(saved(torch.zeros(64 << 20)), "data.pkl", None, zipfile.ZIP_DEFLATED)
    assert len(bomb) < 1 << 20
    before = rss_bytes(os.getpid())
    with pytest.raises(PromptEmbedsError, match="is compressed"):
        load_tensor(bomb, 10**9)
    assert rss_bytes(os.getpid()) - before < 64 << 20


def test_a_pickle_that_would_run_code_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    payload = code_running_archive(marker)
    # The payload is live: a plain load runs its code.
    torch.load(io.BytesIO(payload), weights_only=False)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(PromptEmbedsError) as excinfo:
        load_tensor(payload, 10**6)
    assert str(excinfo.value) == (
        "prompt_embeds could not be loaded safely (torch.load with weights_only=True): its "
        "pickle asks for more than tensors: Unsupported global: GLOBAL io.open was not an "
        "allowed global by default")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (huge_sparse(), "has layout sparse_coo; only a dense (strided) tensor"),
        (out_of_bounds_sparse(HIDDEN), "has layout sparse_coo"),
        (torch.randn(4, HIDDEN).to_sparse_csr(), "has layout sparse_csr"),
        (torch.ones(4, HIDDEN, dtype=torch.int32), "has dtype int32; it must be float32"),
        (torch.ones(4, HIDDEN, dtype=torch.bool), "has dtype bool"),
        (torch.ones(4, HIDDEN, dtype=torch.complex64), "has dtype complex64"),
        ({"embeds": torch.ones(4, HIDDEN)}, "must hold a tensor, got dict"),
        ([1.0, 2.0], "must hold a tensor, got list"),
        # 4,000 x 16 values from one stored row: far more elements than bytes were sent.
        (torch.zeros(1, HIDDEN).expand(4000, HIDDEN), ("4000, 16): 64000 elements, more than "
                                                      "the cap of 512 (the maximum model")),
    ],
)
def test_only_dense_floating_tensors_within_the_cap_are_loaded(obj: object, message: str) -> None:
    with pytest.raises(PromptEmbedsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decode(encode(obj))


def test_a_sparse_payload_of_terabytes_never_allocates_them() -> None:
    payload = encode(huge_sparse())
    assert len(payload) < 4096
    before = rss_bytes(os.getpid())
    with pytest.raises(PromptEmbedsError, match="sparse_coo"):
        decode(payload)
    assert rss_bytes(os.getpid()) - before < 64 << 20


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.randn(2, 3, HIDDEN), (r"must be 2-D \(num_tokens, hidden_size\), or 3-D with a "
                                    r"batch dimension of 1; got shape \(2, 3, 16\)")),
        (torch.randn(HIDDEN), r"got shape \(16,\)"),
        (torch.randn(4, HIDDEN + 1), "has 17 columns; this model's hidden_size is 16"),
        (torch.full((4, HIDDEN), float("nan")), "holds NaN or infinite values"),
        (torch.tensor([[float("-inf")] * HIDDEN]), "holds NaN or infinite values"),
        (torch.zeros(0, HIDDEN), "has 0 rows: a prompt needs at least one"),
    ],
)
def test_shape_and_values_are_checked(tensor: torch.Tensor, message: str) -> None:
    with pytest.raises(PromptEmbedsError, match=message):
        decode(encode(tensor))
    with pytest.raises(PromptEmbedsError, match=message):
        check_embeds(tensor, HIDDEN, MAX_ROWS)


def test_too_many_rows_are_refused_by_the_element_cap_before_they_are_read() -> None:
    tensor = torch.randn(MAX_ROWS + 1, HIDDEN)
    with pytest.raises(PromptEmbedsError) as excinfo:
        decode(encode(tensor))
    assert str(excinfo.value) == (
        "prompt_embeds declares shape (33, 16): 528 elements, more than the cap of 512 (the "
        "maximum model length of 32 rows of hidden_size 16)")
    # A tensor already in memory (the offline API) meets the row check itself.
    with pytest.raises(PromptEmbedsError, match="has 33 rows, more than the maximum model "
                                                "length of 32"):
        check_embeds(tensor, HIDDEN, MAX_ROWS)


def test_without_a_model_the_width_is_not_checked_and_the_payload_caps_elements() -> None:
    """The router's decoding: no hidden size, no row limit, elements capped by bytes sent."""
    tensor = torch.randn(3, HIDDEN + 5)
    assert torch.equal(decode_prompt_embeds(encode(tensor), None, None, CAP), tensor)
    with pytest.raises(PromptEmbedsError, match="elements, more than the cap"):
        decode_prompt_embeds(encode(torch.zeros(1, 8).expand(100_000, 8)), None, None, CAP)


def test_the_salt_keys_dtype_shape_and_values() -> None:
    tensor = torch.randn(6, HIDDEN)
    salt = embeds_salt(tensor)
    assert len(salt) == 32
    assert embeds_salt(tensor.clone()) == salt
    # The decoded payload, a non-contiguous copy and the squeezed form: the same salt.
    assert embeds_salt(decode(encode(tensor))) == salt
    assert embeds_salt(tensor.t().contiguous().t()) == salt
    assert embeds_salt(check_embeds(tensor[None], HIDDEN, MAX_ROWS)) == salt
    changed = tensor.clone()
    changed[5, 15] = torch.nextafter(changed[5, 15], torch.tensor(10.0))
    others = [changed, tensor.double(), tensor.bfloat16(), tensor.reshape(12, HIDDEN // 2),
              tensor[:5]]
    assert len({salt, *map(embeds_salt, others)}) == 1 + len(others)
