"""How a launch of the unified attention kernel is shaped: its tiles, warps, pipeline stages
and grid.

On a GPU the shape comes from a tuning table: for decode launches (few queries per request)
and prefill launches, per padded head size, the query rows per program, the keys per tile,
the warps and the software-pipeline stages, plus when decode launches split their keys
(split-KV). The built-in table holds what `benchmarks/attention_tuning.py` measured on a
Hopper GPU and applies to Hopper GPUs (compute capability 9.x); that script writes a table
of the same form for the GPU it runs on, and the environment variable
KVFERRY_ATTENTION_TUNING naming such a file makes every launch of the process use it, on
any GPU (read once, on the first launch). Other GPUs, and head sizes a table lacks, fall
back to `gpu_tiles`, which sizes tiles by a register budget.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from kvferry.engine.attention.triton._runtime import next_power_of_2
from kvferry.engine.attention.triton.split_kv import MIN_KEYS_PER_SPLIT, TARGET_PROGRAMS

TUNING_ENV = "KVFERRY_ATTENTION_TUNING"
# Register budget per program of `gpu_tiles`, in bytes of query rows plus keys times
# head dims.
TILE_BUDGET_BYTES = 24576
# Launches whose longest query is at most this many tokens take the decode tiles; their
# programs need no more than tl.dot's 16 rows.
MAX_DECODE_QUERY_LEN = 8


@dataclass(frozen=True)
class TileConfig:
    """One launch shape: `rows` query rows (queries x the heads of one kv head) per program,
    `tile_n` keys per loop step, `num_warps`, and `num_stages` (None: Triton's default)."""

    rows: int
    tile_n: int
    num_warps: int
    num_stages: int | None = None

    def __post_init__(self) -> None:
        # (name, least, most): powers of two; tl.dot needs 16 rows and keys, a program has
        # at most 32 warps.
        for name, least, most in (("rows", 16, 256), ("tile_n", 16, 256), ("num_warps", 1, 32)):
            value = getattr(self, name)
            if (not _is_int(value) or not least <= value <= most
                    or value != next_power_of_2(value)):
                raise ValueError(f"{name} must be a power of two in {least}..{most}, "
                                 f"got {value!r}")
        if self.num_stages is not None and (
            not _is_int(self.num_stages) or not 1 <= self.num_stages <= 8
        ):
            raise ValueError(f"num_stages must be None or 1..8, got {self.num_stages!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class AttentionTuning:
    """Tile configs by launch kind ("decode", "prefill") and padded head size, and the
    split-KV policy: decode launches with fewer (request, kv head) programs than
    `target_programs` split their keys, each split keeping `min_keys_per_split` keys."""

    decode: dict[int, TileConfig] = field(default_factory=dict)
    prefill: dict[int, TileConfig] = field(default_factory=dict)
    target_programs: int = TARGET_PROGRAMS
    min_keys_per_split: int = MIN_KEYS_PER_SPLIT
    source: str = "built-in"

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> AttentionTuning:
        """A table from its JSON form (as `to_dict` writes it); ValueError (for a wrong type
        too: the file is the input) names what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(  # noqa: TRY004
                f"{source}: an attention tuning table is a JSON object")
        tables: dict[str, dict[int, TileConfig]] = {}
        for kind in ("decode", "prefill"):
            entries = data.get(kind, {})
            if not isinstance(entries, dict):
                raise ValueError(  # noqa: TRY004
                    f"{source}: {kind!r} must map head sizes to tile configs")
            tables[kind] = {}
            for head, config in entries.items():
                try:
                    block_d = int(head)
                    if block_d != max(16, next_power_of_2(block_d)) or block_d > 256:
                        raise ValueError("head sizes are keyed padded: a power of two in "
                                         "16..256 (head size 80 takes 128's entry)")
                    if not isinstance(config, dict):
                        raise ValueError("a tile config is an object")  # noqa: TRY004
                    tables[kind][block_d] = TileConfig(**config)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{source}: {kind}[{head!r}]: {exc}") from None
        split = data.get("split", {})
        if not isinstance(split, dict):
            raise ValueError(f"{source}: 'split' must be an object")  # noqa: TRY004
        target = split.get("target_programs", cls.target_programs)
        min_keys = split.get("min_keys_per_split", cls.min_keys_per_split)
        for name, value in (("target_programs", target), ("min_keys_per_split", min_keys)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{source}: split.{name} must be a positive integer")
        return cls(tables["decode"], tables["prefill"], target, min_keys, source)

    def to_dict(self) -> dict[str, Any]:
        def table(configs: dict[int, TileConfig]) -> dict[str, Any]:
            return {str(head): asdict(config) for head, config in sorted(configs.items())}

        return {
            "decode": table(self.decode),
            "prefill": table(self.prefill),
            "split": {"target_programs": self.target_programs,
                      "min_keys_per_split": self.min_keys_per_split},
        }


# No table: every launch sized by `gpu_tiles`, the default split policy.
NO_TABLE = AttentionTuning(source="none")
# Measured by benchmarks/attention_tuning.py on one NVIDIA H100 80GB HBM3 (Triton 3.6,
# 2026-11-27; benchmarks/README.md has the figures); used on compute capability 9.x. Split-KV
# paid on none of the decode shapes measured (64 and 128 requests), so the split policy
# stays the default.
BUILT_IN = AttentionTuning(
    decode={
        64: TileConfig(rows=16, tile_n=64, num_warps=4, num_stages=2),
        128: TileConfig(rows=16, tile_n=32, num_warps=4, num_stages=2),
    },
    prefill={
        64: TileConfig(rows=128, tile_n=64, num_warps=8, num_stages=2),
        128: TileConfig(rows=128, tile_n=64, num_warps=4, num_stages=2),
    },
)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of `device` (None for any other device)."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None
                            else torch.cuda.current_device())


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def attention_tuning(capability: tuple[int, int] | None = None) -> AttentionTuning:
    """The table launches on a GPU of `capability` use: the file KVFERRY_ATTENTION_TUNING
    names (whatever the GPU), else the built-in one on Hopper (9.x), else none. A file that
    cannot be read or parsed is an error, not a silent fallback."""
    path = os.environ.get(TUNING_ENV)
    if not path:
        return BUILT_IN if capability is not None and capability[0] == 9 else NO_TABLE
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{TUNING_ENV}={path}: cannot read an attention tuning table: {exc}")
    return AttentionTuning.from_dict(data, source=path)


def launch_config(
    query: torch.Tensor,
    num_kv_heads: int,
    max_query_len: int,
    interpreted: bool,
    config: TileConfig | None = None,
    tuning: AttentionTuning | None = None,
) -> dict[str, Any]:
    """The kernel's constexprs and launch options: BLOCK_Q queries by GROUP heads per
    program, TILE_N keys per step, BLOCK_D padded head dims, how the dots run, warps and
    stages. `config` overrides the table (the tuning benchmark's candidates; under the
    interpreter too, where only its tile shape matters); `tuning` is the table (None:
    `attention_tuning` for the query's device)."""
    num_heads, head_size = query.shape[1:]
    group = next_power_of_2(num_heads // num_kv_heads)
    block_d = max(16, next_power_of_2(head_size))
    options: dict[str, Any] = {"num_warps": 8}
    if interpreted and config is None:
        # The interpreter pays per operation, not per element: few, large tiles.
        rows, tile_n = (64 if max_query_len * group >= 32 else 16), 32
    else:
        if config is None:
            if tuning is None:
                tuning = attention_tuning(device_capability(query.device))
            config = tile_config(tuning, group, block_d, max_query_len, query.element_size())
        rows, tile_n = max(config.rows, group), config.tile_n
        options["num_warps"] = config.num_warps
        if config.num_stages is not None:
            options["num_stages"] = config.num_stages
    return {
        "BLOCK_Q": max(1, rows // group),
        "GROUP": group,
        "BLOCK_D": block_d,
        "PAD_D": block_d != head_size,
        "TILE_N": tile_n,
        # float32 attention stays float32 (no TF32) to match the torch path; half types
        # take the target's default.
        "DOT_PRECISION": "ieee" if query.dtype == torch.float32 else None,
        "DOT_IN_FP32": interpreted and query.dtype == torch.bfloat16,
        **options,
    }


def tile_config(tuning: AttentionTuning, group: int, block_d: int, max_query_len: int,
                element_size: int) -> TileConfig:
    """`tuning`'s config for this launch, or `gpu_tiles`' where the table has none.

    The tables are measured for 16-bit caches; float32 ones (twice the registers per
    element) always take `gpu_tiles`."""
    kind = tuning.decode if max_query_len <= MAX_DECODE_QUERY_LEN else tuning.prefill
    config = kind.get(block_d) if element_size <= 2 else None
    if config is not None:
        return config
    rows, tile_n = gpu_tiles(group, block_d, max_query_len, element_size)
    return TileConfig(rows, tile_n, num_warps=8)


def gpu_tiles(group: int, block_d: int, max_query_len: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_M, TILE_N) for a GPU: the largest that keep a program's query tile and its
    gathered key/value pointers in registers.

    Each key of a tile is gathered through the block table, so the K and V tiles need a
    pointer per element; past about TILE_BUDGET_BYTES of (query rows + keys) x head dims
    per program (8 warps), ptxas spills (its register reports for sm_90, Triton 3.9).
    """
    budget = TILE_BUDGET_BYTES // element_size
    # tl.dot needs 16 rows; a program of many queries amortizes each key tile (prefill).
    rows = max(64 if max_query_len * group >= 64 else 16, group)
    while rows > max(16, group) and block_d * (rows + 16) > budget:
        rows //= 2
    tile_n = 64
    while tile_n > 16 and block_d * (tile_n + rows) > budget:
        tile_n //= 2
    return rows, tile_n


def grid_size(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Programs along the query axis: every request gets its own blocks of BLOCK_Q queries.

    Request i's blocks start at `query_start_loc[i] // BLOCK_Q + i`. Worked example with
    BLOCK_Q 4 and query lengths [5, 1, 6] (starts 0, 5, 6): request 0 starts at 0 and needs
    2 blocks, request 1 starts at 5 // 4 + 1 = 2 and needs 1, request 2 starts at
    6 // 4 + 2 = 3 and needs 2; 12 // 4 + 3 = 6 blocks cover them, one of them spare (its
    program finds its request already covered and returns).
    """
    return num_tokens // block_q + num_seqs
