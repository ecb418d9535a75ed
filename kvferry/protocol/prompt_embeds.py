"""Prompt embeddings: how a client's tensor is checked, decoded from its wire form, and keyed
for the prefix cache, alike in the engine pods and the router.

A prompt given as embeddings is a `(num_tokens, hidden_size)` floating tensor used in place of
the embedding-table lookup of its tokens. Over HTTP it arrives as `prompt_embeds`: base64 text
of the bytes `torch.save(tensor)` writes, as vLLM's clients send it. Nothing in those bytes is
trusted; each step below refuses with a `PromptEmbedsError` that names it:

1. size: the base64 text and the bytes it decodes to are capped before anything parses them;
2. archive: the bytes must be the zip archive `torch.save` writes, every member stored
   uncompressed and their sizes within the bytes sent (a compressed member could inflate far
   past any cap once the loader reads it);
3. load: `torch.load(weights_only=True, map_location="cpu")`, whose unpickler rebuilds tensors
   and plain containers and calls nothing else (a pickle that would run code is refused);
4. layout: only a dense (strided) floating tensor on the CPU. Sparse, quantized and nested
   tensors are refused before any conversion: densifying a sparse tensor whose indices were
   never validated writes out of bounds, and one whose declared dense shape is terabytes
   allocates that much;
5. size again: the declared element count (which strides of 0 can make far larger than the
   bytes sent) against the cap, before any operation touches the elements;
6. shape and values: 2-D once a leading batch dimension of 1 is squeezed, `hidden_size`
   columns, every value finite, 1..max rows.

The offline API takes tensors directly and runs steps 4-6 on them.

Prefix caching: an embedding prompt's token-id row holds placeholders, so its KV blocks are
keyed by `embeds_salt`, a hash of the checked tensor (its dtype, shape and bytes as the client
gave them, before the cast to the model's dtype), given as the blocks' extra key: identical
embedding prompts share blocks, and none can match a token prompt's. The router computes the
same salt from the same payload, so its prefix index speaks of the same blocks.

torch is imported where it is used: the router imports this module without needing it until
a request carries embeddings.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import struct
import zipfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The token id that stands for each prompt position of an embedding prompt in token-id rows
# and block hashes. Its value never reaches the model: those positions read the embeddings.
PLACEHOLDER_TOKEN_ID = 0
# Bytes a `torch.save` archive holds besides the tensor's own (pickle, version, member
# headers, 64-byte alignment): a few hundred for one tensor; this leaves room to spare.
ARCHIVE_OVERHEAD_BYTES = 64 * 1024
# `torch.save` of one tensor writes five members; a payload with many more is not one.
MAX_ARCHIVE_MEMBERS = 64
# The widest floating dtype (float64), for the byte cap of a payload of N elements.
MAX_ELEMENT_BYTES = 8
_ZIP_MAGIC = b"PK\x03\x04"
_SALT_DOMAIN = b"kvferry-prompt-embeds-v1\x00"


class PromptEmbedsError(ValueError):
    """A prompt embedding refused; the message says which check failed."""


def max_payload_bytes(max_rows: int, hidden_size: int) -> int:
    """The most bytes a `torch.save` payload of a valid prompt can take: `max_rows` rows of
    `hidden_size` float64 values and the archive around them."""
    return max_rows * hidden_size * MAX_ELEMENT_BYTES + ARCHIVE_OVERHEAD_BYTES


def max_base64_chars(max_bytes: int) -> int:
    """Characters of base64 text that decode to at most `max_bytes` bytes."""
    return 4 * -(-max_bytes // 3)


# ---------------------------------------------------------------- 1. size, base64
def decode_base64(text: str, max_bytes: int, where: str = "prompt_embeds") -> bytes:
    """The bytes of base64 `text`, refused when longer than `max_bytes` before or after
    decoding, or when it is not base64 (standard alphabet, padded, no whitespace)."""
    if not isinstance(text, str):
        raise PromptEmbedsError(f"{where} must be a base64 string, got {type(text).__name__}")
    max_chars = max_base64_chars(max_bytes)
    if len(text) > max_chars:
        raise PromptEmbedsError(
            f"{where} is {len(text)} characters of base64, more than the cap of {max_chars} "
            f"({max_bytes} bytes decoded) for this model's prompts")
    try:
        payload = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PromptEmbedsError(f"{where} is not valid base64: {exc}") from None
    if len(payload) > max_bytes:
        raise PromptEmbedsError(f"{where} decodes to {len(payload)} bytes, more than the cap "
                                f"of {max_bytes}")
    return payload


# ---------------------------------------------------------------- 2-5. archive, load, layout
def load_tensor(payload: bytes, max_elements: int, where: str = "prompt_embeds",
                cap_note: str = "") -> torch.Tensor:
    """The tensor `torch.save` wrote into `payload`, loaded without running code and checked
    to be a dense CPU floating tensor of at most `max_elements` elements; nothing has touched
    its elements yet."""
    check_archive(payload, where)
    import torch

    try:
        loaded = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - the bytes are the client's: any failure is its 400
        raise PromptEmbedsError(f"{where} could not be loaded safely (torch.load with "
                                f"weights_only=True): {_load_failure(exc)}") from None
    return check_dense_floating(loaded, max_elements, where, cap_note)


def _load_failure(exc: Exception) -> str:
    """What went wrong, for the client: the restricted unpickler's own reason (not its advice
    to whoever runs the server on loosening it), else the error's first line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    found = re.search(r"WeightsUnpickler error: (.*?)(?:\. Please|\n|$)", text)
    if found:
        return f"its pickle asks for more than tensors: {found.group(1)[:200]}"
    first = text.strip().splitlines()[0][:200] if text.strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def check_archive(payload: bytes, where: str = "prompt_embeds") -> None:
    """Refuses bytes that are not a `torch.save` zip archive of stored (uncompressed) members
    whose sizes fit in the bytes themselves. Only the central directory is read."""
    if not payload.startswith(_ZIP_MAGIC):
        raise PromptEmbedsError(f"{where} is not a torch.save archive (a zip file): send "
                                "base64 of the bytes torch.save(tensor) writes")
    try:
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError) as exc:
        raise PromptEmbedsError(f"{where} is not a readable torch.save archive: {exc}") from None
    if len(members) > MAX_ARCHIVE_MEMBERS:
        raise PromptEmbedsError(f"{where} is an archive of {len(members)} members, more than "
                                f"the {MAX_ARCHIVE_MEMBERS} a torch.save of one tensor can have")
    for member in members:
        if member.compress_type != zipfile.ZIP_STORED:
            raise PromptEmbedsError(f"{where}: archive member {member.filename[:80]!r} is "
                                    "compressed; torch.save stores members uncompressed")
    declared = sum(member.file_size for member in members)
    if declared > len(payload):
        raise PromptEmbedsError(f"{where}: the archive declares {declared} bytes of members "
                                f"in {len(payload)} bytes")


def check_dense_floating(obj: object, max_elements: int | None,
                         where: str = "prompt_embeds", cap_note: str = "") -> torch.Tensor:
    """`obj` if it is a dense (strided) floating tensor on the CPU with at most
    `max_elements` elements (None: not capped; `cap_note` says where the cap comes from);
    the layout is looked at before anything else, and nothing here reads an element."""
    import torch

    if not isinstance(obj, torch.Tensor) or type(obj) not in (torch.Tensor, torch.nn.Parameter):
        raise PromptEmbedsError(f"{where} must hold a tensor, got {type(obj).__name__}")
    if obj.is_nested:
        raise PromptEmbedsError(f"{where} is a nested tensor; only a dense (strided) tensor "
                                "is accepted")
    if obj.layout != torch.strided:
        raise PromptEmbedsError(f"{where} has layout {str(obj.layout).removeprefix('torch.')}; "
                                "only a dense (strided) tensor is accepted")
    if obj.is_quantized:
        raise PromptEmbedsError(f"{where} is a quantized tensor; only a dense floating tensor "
                                "is accepted")
    if obj.device.type != "cpu":
        raise PromptEmbedsError(f"{where} is on device {obj.device.type}, not the CPU")
    if obj.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise PromptEmbedsError(f"{where} has dtype {str(obj.dtype).removeprefix('torch.')}; "
                                "it must be float32, bfloat16, float16 or float64")
    num_elements = 1
    for size in obj.shape:
        num_elements *= size
    if max_elements is not None and num_elements > max_elements:
        raise PromptEmbedsError(f"{where} declares shape {tuple(obj.shape)}: {num_elements} "
                                f"elements, more than the cap of {max_elements}{cap_note}")
    return obj.detach()


# ---------------------------------------------------------------- 6. shape and values
def check_embeds(tensor: torch.Tensor, hidden_size: int | None, max_rows: int | None,
                 where: str = "prompt_embeds") -> torch.Tensor:
    """The 2-D `(num_tokens, hidden_size)` view of a dense floating tensor (a leading batch
    dimension of 1 is squeezed), refused unless it has `hidden_size` columns (None: not
    checked), finite values and 1..`max_rows` rows (None: no upper bound)."""
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2:
        raise PromptEmbedsError(f"{where} must be 2-D (num_tokens, hidden_size), or 3-D with a "
                                f"batch dimension of 1; got shape {tuple(tensor.shape)}")
    num_rows, width = tensor.shape
    if hidden_size is not None and width != hidden_size:
        raise PromptEmbedsError(f"{where} has {width} columns; this model's hidden_size is "
                                f"{hidden_size}")
    if num_rows and not bool(tensor.isfinite().all()):
        raise PromptEmbedsError(f"{where} holds NaN or infinite values")
    if num_rows < 1:
        raise PromptEmbedsError(f"{where} has 0 rows: a prompt needs at least one")
    if max_rows is not None and num_rows > max_rows:
        raise PromptEmbedsError(f"{where} has {num_rows} rows, more than the maximum model "
                                f"length of {max_rows}")
    return tensor


def embeds_salt(tensor: torch.Tensor) -> bytes:
    """The prefix-cache key of a checked 2-D prompt embedding: sha256 over its dtype, shape
    and bytes (row-major), as the client gave them."""
    import torch

    dense = tensor.contiguous()
    digest = hashlib.sha256(_SALT_DOMAIN)
    digest.update(str(dense.dtype).removeprefix("torch.").encode() + b"\x00")
    digest.update(struct.pack("<qq", *dense.shape))
    digest.update(memoryview(dense.view(torch.uint8).numpy()))
    return digest.digest()


def decode_prompt_embeds(text: str, hidden_size: int | None, max_rows: int | None,
                         max_bytes: int, max_elements: int | None = None,
                         where: str = "prompt_embeds") -> torch.Tensor:
    """Steps 1-6 on one base64 payload: the checked 2-D tensor, in the dtype it was sent in.

    `max_elements` defaults to `max_rows * hidden_size` (what a valid prompt can hold), and
    without those to the payload's byte count (no floating element takes less than a byte).
    """
    payload = decode_base64(text, max_bytes, where)
    cap_note = ""
    if max_elements is None and max_rows is not None and hidden_size:
        max_elements = max_rows * hidden_size
        cap_note = (f" (the maximum model length of {max_rows} rows of hidden_size "
                    f"{hidden_size})")
    elif max_elements is None:
        max_elements = len(payload)
        cap_note = " (one per byte sent)"
    tensor = load_tensor(payload, max_elements, where, cap_note)
    return check_embeds(tensor, hidden_size, max_rows, where)
