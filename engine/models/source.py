"""Turns a `--model` value into a local checkpoint directory.

Three kinds of source: an existing directory (used as is), a demo (`demo`, the built-in
random Llama; `demo-bart` and `demo-whisper`, random encoder-decoder models; each created
once in the cache), or a hub id such as `Qwen/Qwen3-0.6B`, downloaded with
`huggingface_hub` when it is installed and the network is reachable.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEMO_SOURCE = "demo"
# Every demo source -> its directory in the cache (bump a version when the checkpoint's
# contents change, so stale caches are not reused).
DEMO_DIRS = {"demo": "demo-v1", "demo-bart": "demo-bart-v1", "demo-whisper": "demo-whisper-v1"}
DEMO_SOURCES = tuple(DEMO_DIRS)
# Only the files the engine reads are fetched from the hub.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


def default_cache_dir() -> Path:
    """`$KVFERRY_CACHE`, else `~/.cache/kvferry`."""
    env = os.environ.get("KVFERRY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvferry"


def _create_demo(source: str, path: Path) -> None:
    if source == "demo-bart":
        from kvferry.engine.models.demo_encdec import create_demo_bart_checkpoint

        create_demo_bart_checkpoint(path)
    elif source == "demo-whisper":
        from kvferry.engine.models.demo_encdec import create_demo_whisper_checkpoint

        create_demo_whisper_checkpoint(path)
    else:
        from kvferry.engine.models.demo import create_demo_checkpoint

        create_demo_checkpoint(path)


def _ensure_demo(cache_dir: Path, source: str = DEMO_SOURCE) -> Path:
    """Creates the demo checkpoint `source` under `cache_dir` unless it is already there.

    It is written into a temporary sibling directory and renamed into place, so a
    concurrent reader never sees a half-written checkpoint; when two processes race,
    the loser discards its copy (both copies are byte-identical anyway).
    """
    name = DEMO_DIRS[source]
    final = cache_dir / name
    if (final / "config.json").is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        _create_demo(source, tmp)
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
    """Returns a local checkpoint directory for `src` (a directory, a demo, or a hub id)."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if src in DEMO_DIRS:
        return _ensure_demo(Path(cache_dir) if cache_dir is not None else default_cache_dir(),
                            src)
    if not _looks_like_hub_id(src):
        raise ValueError(f"model path {src!r} does not exist (and is not a hub id)")
    try:
        return download_from_hub(src)
    except ValueError as exc:
        raise ValueError(f"model source {src!r} is not an existing directory; a hub id needs "
                         f"huggingface_hub and network access ({exc})") from exc
