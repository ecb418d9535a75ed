"""Turns a `--model` value into a local checkpoint directory.

Three kinds of source: an existing directory (used as is), `demo` (the built-in random
model, created once in the cache), or a hub id such as `Qwen/Qwen3-0.6B`, downloaded
with `huggingface_hub` when it is installed and the network is reachable.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEMO_SOURCE = "demo"
# Bump when the demo checkpoint's contents change, so stale caches are not reused.
_DEMO_DIR_NAME = "demo-v1"
# Only the files the engine reads are fetched from the hub.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


def default_cache_dir() -> Path:
    """`$KVFERRY_CACHE`, else `~/.cache/kvferry`."""
    env = os.environ.get("KVFERRY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvferry"


def _ensure_demo(cache_dir: Path) -> Path:
    """Creates the demo checkpoint under `cache_dir` unless it is already there.

    It is written into a temporary sibling directory and renamed into place, so a
    concurrent reader never sees a half-written checkpoint; when two processes race,
    the loser discards its copy (both copies are byte-identical anyway).
    """
    from kvferry.engine.models.demo import create_demo_checkpoint

    final = cache_dir / _DEMO_DIR_NAME
    if (final / "config.json").is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_DEMO_DIR_NAME}-", dir=cache_dir))
    try:
        create_demo_checkpoint(tmp)
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def _looks_like_hub_id(src: str) -> bool:
    """`name` or `org/name`, not a filesystem path."""
    return (
        not src.startswith(("/", ".", "~"))
        and src.count("/") <= 1
        and os.sep not in src.replace("/", "")
        and bool(src.strip("/"))
    )


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def download_from_hub(repo_id: str) -> Path:
    """The hub checkpoint `repo_id` in the local hub cache, downloaded unless it is there.

    ValueError says why it cannot be had: huggingface_hub missing, HF_HUB_OFFLINE set (and
    the checkpoint not cached), no network, or no such repository.
    """
    if _hub_offline():
        raise ValueError(f"cannot download {repo_id!r}: HF_HUB_OFFLINE is set")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"cannot download {repo_id!r}: huggingface_hub is not installed "
                         "(pip install huggingface_hub)") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except (OSError, ValueError) as exc:
        # huggingface_hub's connection, HTTP and repo-not-found errors are OSErrors;
        # a malformed repo id is a ValueError. Their messages run over several lines.
        reason = " ".join(str(exc).split())
        raise ValueError(f"cannot download {repo_id!r} from the hub: {reason}") from exc


def resolve_model_source(src: str, cache_dir: Path | None = None) -> Path:
    """Returns a local checkpoint directory for `src` (a directory, `demo`, or a hub id)."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if src == DEMO_SOURCE:
        return _ensure_demo(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    if not _looks_like_hub_id(src):
        raise ValueError(f"model path {src!r} does not exist (and is not a hub id)")
    try:
        return download_from_hub(src)
    except ValueError as exc:
        raise ValueError(f"model source {src!r} is not an existing directory; a hub id needs "
                         f"huggingface_hub and network access ({exc})") from exc
