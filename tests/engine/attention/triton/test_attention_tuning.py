"""The unified attention kernel's launch shapes: the built-in tuning table (Hopper GPUs),
a table file named by KVFERRY_ATTENTION_TUNING (any GPU), the fallback for what a table
lacks, the split policy, and benchmarks/attention_tuning.py (its --smoke run under the
interpreter tries its candidates' tile shapes and writes a table this code reads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from kvferry.engine.attention.triton import _attention_launch as launch
from kvferry.engine.attention.triton._attention_launch import (
    BUILT_IN,
    NO_TABLE,
    TUNING_ENV,
    AttentionTuning,
    TileConfig,
    attention_tuning,
    launch_config,
)
from kvferry.engine.attention.triton.split_kv import choose_num_kv_splits

BENCHMARK = Path(__file__).resolve().parents[4] / "benchmarks" / "attention_tuning.py"


@pytest.fixture(autouse=True)
def no_table_file(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts without a table file in the environment and with no table read,
    and leaves none read (later tests see the built-in table again)."""
    monkeypatch.delenv(TUNING_ENV, raising=False)
    attention_tuning.cache_clear()
    yield
    attention_tuning.cache_clear()


@pytest.fixture
def tuning_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[object], Path]:
    """Writes a table and names it in the environment."""

    def write(data: object) -> Path:
        path = tmp_path / "tuning.json"
        path.write_text(json.dumps(data))
        monkeypatch.setenv(TUNING_ENV, str(path))
        attention_tuning.cache_clear()
        return path

    return write


HOPPER, AMPERE = (9, 0), (8, 0)


def _query(num_heads: int, head_size: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(1, num_heads, head_size, dtype=dtype, device="meta")


def _gpu_config(query: torch.Tensor, num_kv_heads: int, max_query_len: int,
                tuning: AttentionTuning | None = BUILT_IN) -> dict:
    return launch_config(query, num_kv_heads, max_query_len, interpreted=False, tuning=tuning)


def test_the_built_in_table_is_for_hopper_gpus() -> None:
    assert attention_tuning(HOPPER) is BUILT_IN and attention_tuning((9, 2)) is BUILT_IN
    # Measured on an H100: other GPUs (and a launch without a device) size tiles themselves.
    assert attention_tuning(AMPERE) is NO_TABLE and attention_tuning(None) is NO_TABLE
    assert NO_TABLE.decode == {} and NO_TABLE.prefill == {}
    # A launch on a device that is no GPU (here: meta) looks up no table.
    config = launch_config(_query(32, 128), 8, 1, interpreted=False)
    assert (config["BLOCK_Q"] * config["GROUP"], config["TILE_N"]) == launch.gpu_tiles(
        4, 128, 1, 2)


def test_gpu_launches_take_the_built_in_table() -> None:
    decode, prefill = BUILT_IN.decode[128], BUILT_IN.prefill[128]
    config = _gpu_config(_query(32, 128), 8, max_query_len=1)
    assert (config["TILE_N"], config["num_warps"], config["num_stages"]) == (
        decode.tile_n, decode.num_warps, decode.num_stages)
    assert config["BLOCK_Q"] * config["GROUP"] == decode.rows and config["GROUP"] == 4
    assert config["PAD_D"] is False
    config = _gpu_config(_query(32, 128), 8, max_query_len=512)
    assert config["BLOCK_Q"] == prefill.rows // 4 and config["TILE_N"] == prefill.tile_n
    # Head size 80 pads to 128 dims and takes 128's row; the padding is masked.
    config = _gpu_config(_query(32, 80), 8, max_query_len=1)
    assert config["BLOCK_D"] == 128 and config["PAD_D"] is True
    assert config["TILE_N"] == decode.tile_n
    # A group wider than the table's rows still gets all its heads in one program.
    config = _gpu_config(_query(32, 64), 1, max_query_len=1)
    assert config["GROUP"] == 32 and config["BLOCK_Q"] == 1


def test_what_the_table_lacks_falls_back_to_the_register_budget() -> None:
    # float32 caches (twice the registers per element) and head sizes the table lacks.
    for query, rows_tile in ((_query(32, 128, torch.float32), launch.gpu_tiles(4, 128, 1, 4)),
                             (_query(8, 256), launch.gpu_tiles(4, 256, 1, 2))):
        config = _gpu_config(query, query.shape[1] // 4, max_query_len=1)
        assert (config["BLOCK_Q"] * config["GROUP"], config["TILE_N"]) == rows_tile
        assert config["num_warps"] == 8 and "num_stages" not in config


def test_the_interpreter_ignores_the_table_but_takes_a_given_config() -> None:
    config = launch_config(_query(32, 128), 8, 1, interpreted=True, tuning=BUILT_IN)
    assert config["TILE_N"] == 32 and "num_stages" not in config
    # The tuning benchmark's candidates: their tile shape runs under the interpreter too.
    given = TileConfig(rows=64, tile_n=128, num_warps=2, num_stages=4)
    config = launch_config(_query(32, 128), 8, 1, interpreted=True, config=given)
    assert (config["BLOCK_Q"], config["TILE_N"], config["num_warps"]) == (16, 128, 2)


def test_a_table_file_named_in_the_environment_is_used(tuning_file) -> None:
    tuning_file({"decode": {"128": {"rows": 32, "tile_n": 128, "num_warps": 2,
                                    "num_stages": 5}},
                 "split": {"target_programs": 1024, "min_keys_per_split": 256},
                 "measured_on": "a GPU"})
    tuning = attention_tuning(AMPERE)  # a file applies whatever the GPU
    assert attention_tuning(HOPPER) == tuning and attention_tuning(None) == tuning
    assert tuning.target_programs == 1024 and tuning.min_keys_per_split == 256
    assert tuning.prefill == {}  # not in the file: the fallback, not the built-in table
    config = _gpu_config(_query(32, 128), 8, max_query_len=1, tuning=tuning)
    assert (config["BLOCK_Q"], config["TILE_N"], config["num_warps"], config["num_stages"]) == (
        8, 128, 2, 5)
    config = _gpu_config(_query(32, 128), 8, max_query_len=100, tuning=tuning)
    assert config["num_warps"] == 8 and "num_stages" not in config


@pytest.mark.parametrize(("data", "match"), [
    ({"decode": {"128": {"rows": 16, "tile_n": 24, "num_warps": 4}}},
     r"decode\['128'\]: tile_n must be a power of two in 16..256"),
    ({"prefill": {"64": {"rows": 8, "tile_n": 32, "num_warps": 4}}},
     r"prefill\['64'\]: rows must be a power of two in 16..256"),
    ({"decode": {"wide": {"rows": 16, "tile_n": 32, "num_warps": 4}}}, r"decode\['wide'\]"),
    ({"decode": {"64": {"rows": 16, "tile_n": 32, "num_warps": 4, "stages": 2}}},
     r"decode\['64'\]: .*unexpected keyword"),
    ({"decode": {"64": {"rows": 16, "tile_n": 32, "num_warps": 4, "num_stages": 0}}},
     "num_stages must be None or 1..8"),
    ({"split": {"target_programs": -1}}, "split.target_programs must be a positive integer"),
    ({"split": {"target_programs": True}}, "split.target_programs must be a positive integer"),
    ({"split": [1024]}, "'split' must be an object"),
    ({"split": None}, "'split' must be an object"),
    ({"decode": {"128": {"rows": 16, "tile_n": 32, "num_warps": True}}},
     "num_warps must be a power of two in 1..32"),
    ({"decode": {"128": {"rows": 16, "tile_n": 32, "num_warps": 64}}},
     "num_warps must be a power of two in 1..32"),
    ({"decode": {"128": {"rows": 512, "tile_n": 32, "num_warps": 4}}},
     "rows must be a power of two in 16..256"),
    ({"decode": {"80": {"rows": 16, "tile_n": 32, "num_warps": 4}}},
     r"decode\['80'\]: head sizes are keyed padded"),
    ({"decode": {"128": [16, 32, 4]}}, r"decode\['128'\]: a tile config is an object"),
    ({"decode": [1, 2]}, "'decode' must map head sizes to tile configs"),
    ([], "a JSON object"),
])
def test_a_bad_table_file_is_refused_by_name(tuning_file, data, match) -> None:
    path = tuning_file(data)
    with pytest.raises(ValueError, match=match) as raised:
        attention_tuning(HOPPER)
    assert str(path) in str(raised.value)


def test_an_unreadable_table_file_is_an_error(tuning_file, tmp_path: Path) -> None:
    tuning_file({})
    os.environ[TUNING_ENV] = str(tmp_path / "missing.json")
    attention_tuning.cache_clear()
    with pytest.raises(ValueError, match=f"{TUNING_ENV}=.*missing.json: cannot read"):
        attention_tuning(HOPPER)


def test_a_table_survives_its_json_form() -> None:
    tuning = AttentionTuning({64: TileConfig(16, 64, 4, 2)}, {128: TileConfig(128, 64, 8)},
                             target_programs=512, min_keys_per_split=1024)
    again = AttentionTuning.from_dict(json.loads(json.dumps(tuning.to_dict())), "x")
    assert (again.decode, again.prefill, again.target_programs, again.min_keys_per_split) == (
        tuning.decode, tuning.prefill, 512, 1024)
    assert AttentionTuning.from_dict(BUILT_IN.to_dict(), "x").decode == BUILT_IN.decode


def test_the_split_policy_is_a_parameter() -> None:
    # 64 decodes x 8 kv heads = 512 programs: no split by default, 4 for a target of 2048
    # (each split keeps >= 512 keys of 4096), 2 where splits need 2048 keys.
    assert choose_num_kv_splits(64, 8, 1, 4096) == 1
    assert choose_num_kv_splits(64, 8, 1, 4096, target_programs=2048) == 4
    assert choose_num_kv_splits(64, 8, 1, 4096, target_programs=2048,
                                min_keys_per_split=2048) == 2


def test_the_tuning_benchmark_writes_a_table_the_engine_reads(tmp_path: Path) -> None:
    out = tmp_path / "tuning.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    table = AttentionTuning.from_dict(json.loads(out.read_text()), str(out))
    assert table.to_dict() == {k: v for k, v in figures["tuning"].items() if k != "measured_on"}
    # Every smoke shape had its candidates checked against SDPA and timed; none refused.
    for name in ("decode_d32_3x64", "prefill_d32_2x48"):
        entry = figures[name]
        assert entry["refused"] == [] and entry["tuned_ms"] > 0, entry
        assert entry["config"] is not None
    assert set(table.decode) == {32} and set(table.prefill) == {32}
