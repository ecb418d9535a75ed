"""Prompt embeddings for the tests: a checkpoint's own embedding rows, their wire form (base64
of `torch.save` bytes, as vLLM's clients send), and hostile payloads."""

from __future__ import annotations

import base64
import io
import pickle
import zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file


def embedding_table(checkpoint: Path) -> torch.Tensor:
    """The checkpoint's embed_tokens weight, (vocab_size, hidden_size)."""
    return load_file(str(checkpoint / "model.safetensors"))["model.embed_tokens.weight"]


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def encode(obj: object) -> str:
    """What a client sends as `prompt_embeds`: base64 of `torch.save(obj)`."""
    return b64(saved(obj))


def b64(payload: bytes) -> str:
    return base64.b64encode(payload).decode()


class _CreatesFile:
    """Unpickled without restrictions, this opens (so creates) `path` for writing."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.path), "w")


def code_running_pickle(marker: Path) -> bytes:
    """A pickle that creates `marker` when a plain unpickler loads it."""
    return pickle.dumps(_CreatesFile(marker), protocol=2)


def with_member(archive: bytes, suffix: str, data: bytes | None = None,
                compression: int = zipfile.ZIP_STORED) -> bytes:
    """The `torch.save` archive with the member ending in `suffix` replaced by `data` (kept
    when None), every member written with `compression`."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=compression) as target:
        for info in source.infolist():
            content = source.read(info.filename)
            if info.filename.endswith(suffix) and data is not None:
                content = data
            target.writestr(info.filename, content, compress_type=compression)
    return out.getvalue()


def code_running_archive(marker: Path) -> bytes:
    """A `torch.save` archive whose pickle creates `marker` when loaded without
    weights_only: it gets past the archive checks to the loader itself."""
    return with_member(saved(torch.zeros(2, 2)), "data.pkl", code_running_pickle(marker))


def huge_sparse() -> torch.Tensor:
    """A sparse COO tensor of one value whose dense shape is 4 TiB of float32."""
    indices = torch.tensor([[0], [0]])
    return torch.sparse_coo_tensor(indices, torch.tensor([1.0]), (2**20, 2**20))


def out_of_bounds_sparse(hidden_size: int) -> torch.Tensor:
    """A sparse COO tensor whose index lies outside its shape (densifying it writes out of
    bounds where nothing validates the indices)."""
    indices = torch.tensor([[1 << 30], [0]])
    return torch.sparse_coo_tensor(indices, torch.tensor([1.0]), (2, hidden_size),
                                   check_invariants=False)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
