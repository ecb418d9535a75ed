"""Layer partitions, and models built for one pipeline stage: chained by hand, the stages
of a 3-layer checkpoint compute exactly what the whole model computes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from kvferry.engine.attention.backend import AttentionMetadata, KVCacheView
from kvferry.engine.attention.torch_backend import TorchAttentionBackend
from kvferry.engine.executor.partition import (
    PipelineStage,
    pipeline_stages,
    pp_layer_partition,
)
from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.models.loader import check_pipeline_support, load_model

BLOCK_SIZE = 4


# ---------------------------------------------------------------------- partitions
@pytest.mark.parametrize(("num_layers", "pp_size", "expected"), [
    (3, 1, [(0, 3)]),
    (3, 2, [(0, 2), (2, 3)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
    (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
    (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
])
def test_an_even_split_gives_the_remainder_to_the_first_stages(
    num_layers: int, pp_size: int, expected: list[tuple[int, int]],
) -> None:
    assert pp_layer_partition(num_layers, pp_size) == expected


def test_an_explicit_partition_is_taken_as_layer_counts() -> None:
    assert pp_layer_partition(3, 2, [1, 2]) == [(0, 1), (1, 3)]
    assert pp_layer_partition(6, 3, (1, 4, 1)) == [(0, 1), (1, 5), (5, 6)]
    stages = pipeline_stages(3, 2, [1, 2])
    assert stages == [PipelineStage(0, 2, 0, 1), PipelineStage(1, 2, 1, 3)]
    assert [(s.is_first, s.is_last, s.num_layers) for s in stages] == [
        (True, False, 1), (False, True, 2)]


@pytest.mark.parametrize(("args", "message"), [
    ((2, 3, None), "cannot split 2 layers over 3 pipeline stages"),
    ((3, 0, None), "pipeline_parallel_size must be >= 1, got 0"),
    ((3, 2, [3]), r"pp_layer_partition has 1 entries \(\[3\]\); pipeline_parallel_size is 2"),
    ((3, 2, [3, 0]), r"pp_layer_partition \[3, 0\] gives a stage no layers"),
    ((3, 2, [2, 2]), r"pp_layer_partition \[2, 2\] covers 4 layers; the model has 3"),
    ((3, 2, [1.5, 1.5]), "pp_layer_partition must hold integers"),
])
def test_a_bad_partition_is_refused_clearly(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pp_layer_partition(*args)


def test_a_stage_without_layers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"stage 1 has no layers: \[2, 2\)"):
        PipelineStage(1, 2, 2, 2)


# ---------------------------------------------------------------------- partial models
def _metadata(block_table: np.ndarray, num_computed: list[int],
              num_new: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions of requests adding `num_new` tokens after `num_computed`."""
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(num_computed, num_new)])
    rows = np.repeat(np.arange(len(num_new)), num_new)
    slots = block_table[rows, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE \
        + positions % BLOCK_SIZE
    query_start_loc = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
    seq_lens = (np.asarray(num_computed) + np.asarray(num_new)).astype(np.int32)
    metadata = AttentionMetadata(
        num_reqs=len(num_new), num_actual_tokens=int(query_start_loc[-1]),
        max_query_len=max(num_new), max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.from_numpy(query_start_loc), seq_lens=torch.from_numpy(seq_lens),
        block_table=torch.from_numpy(block_table), slot_mapping=torch.from_numpy(slots),
        query_start_loc_np=query_start_loc, seq_lens_np=seq_lens,
    )
    return metadata, torch.from_numpy(positions.astype(np.int64))


def _cache(config: ModelArchConfig, num_layers: int,
           num_blocks: int) -> tuple[torch.Tensor, list[KVCacheView]]:
    cache = torch.zeros(num_blocks, num_layers, 2, BLOCK_SIZE, config.num_kv_heads,
                        config.head_size)
    return cache, [(cache[:, i, 0], cache[:, i, 1]) for i in range(num_layers)]


def _load(path: Path, stage: PipelineStage | None = None) -> torch.nn.Module:
    return load_model(path, torch.float32, TorchAttentionBackend(), torch.device("cpu"), stage)


@pytest.mark.parametrize("counts", [None, [1, 2], [1, 1, 1]])
@pytest.mark.parametrize("tied", [False, True])
def test_stages_chained_by_hand_equal_the_whole_model(
    make_checkpoint: Callable[..., Path], counts: list[int] | None, tied: bool,
) -> None:
    path = make_checkpoint(num_layers=3, tie_word_embeddings=tied)
    whole = _load(path)
    config = whole.config
    stages = [_load(path, s) for s in pipeline_stages(3, len(counts or [2, 1]), counts)]
    # Three requests with distinct shuffled blocks; a prefill step, then a decode step.
    num_blocks = 1 + 3 * 3
    table = np.random.default_rng(0).permutation(np.arange(1, num_blocks)).astype(np.int32)
    table = table[:9].reshape(3, 3)
    whole_cache, whole_views = _cache(config, 3, num_blocks)
    stage_caches = [_cache(config, m.stage.num_layers, num_blocks) for m in stages]
    gen = torch.Generator().manual_seed(1)
    steps = [[5, 3, 7], [1, 1, 1]]
    computed = [0, 0, 0]
    with torch.inference_mode():
        for num_new in steps:
            metadata, positions = _metadata(table, computed, num_new)
            ids = torch.randint(3, config.vocab_size, (sum(num_new),), generator=gen)
            expected = whole(ids, positions, whole_views, metadata)
            out = stages[0](ids, positions, stage_caches[0][1], metadata)
            for model, (_, views) in zip(stages[1:], stage_caches[1:]):
                assert isinstance(out, tuple) and len(out) == 2
                out = model(None, positions, views, metadata, intermediate=out)
            assert isinstance(out, torch.Tensor)
            assert torch.equal(out, expected)
            assert torch.equal(stages[-1].compute_logits(out), whole.compute_logits(expected))
            computed = [c + n for c, n in zip(computed, num_new)]
    # Each stage wrote its layers' keys and values, as the whole model did.
    assert torch.equal(torch.cat([c for c, _ in stage_caches], dim=1), whole_cache)


def _parameter_names(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_a_stage_holds_only_its_part(make_checkpoint: Callable[..., Path], tied: bool) -> None:
    path = make_checkpoint(num_layers=3, tie_word_embeddings=tied)
    first, middle, last = (_load(path, s) for s in pipeline_stages(3, 3))
    layer0 = {n.removeprefix("model.layers.0.") for n in _parameter_names(first)
              if n.startswith("model.layers.0.")}
    assert layer0  # a decoder layer's norms and projections
    layer = {f"model.layers.0.{n}" for n in layer0}
    assert _parameter_names(first) == layer | {"model.embed_tokens.weight"}
    assert _parameter_names(middle) == layer
    head = {"model.embed_tokens.weight"} if tied else {"lm_head.weight"}
    assert _parameter_names(last) == layer | {"model.norm.weight"} | head
    with pytest.raises(ValueError, match="pipeline stage 1 does not embed tokens"):
        middle.get_input_embeddings(torch.tensor([3]))
    with pytest.raises(ValueError, match="pipeline stage 0 has no output head"):
        first.compute_logits(torch.zeros(1, 64))
    with pytest.raises(ValueError, match=r"stage 2 needs the previous stage's"):
        last(torch.tensor([3]), torch.tensor([0]), [], None)  # type: ignore[arg-type]


def test_a_stage_reads_only_its_layers_from_the_checkpoint(
    make_checkpoint: Callable[..., Path], tmp_path: Path,
) -> None:
    from safetensors.torch import load_file, save_file

    source = make_checkpoint(num_layers=3)
    # A copy without layers 0 and 1: the last stage of [2, 1] loads from it, the whole
    # model and the first stage cannot.
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    weights = load_file(str(source / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not k.startswith(("model.layers.0.",
                                                                   "model.layers.1."))}
    save_file(kept, str(tmp_path / "model.safetensors"))
    first, last = pipeline_stages(3, 2)
    model = _load(tmp_path, last)
    got = model.model.layers[0].mlp.down_proj.weight
    assert torch.equal(got, weights["model.layers.2.mlp.down_proj.weight"])
    with pytest.raises(ValueError, match="model.layers.0.input_layernorm.weight"):
        _load(tmp_path, first)
    with pytest.raises(ValueError, match="model.layers.0.input_layernorm.weight"):
        _load(tmp_path)


def test_a_stage_past_the_models_layers_is_refused(make_checkpoint: Callable[..., Path]) -> None:
    path = make_checkpoint(num_layers=3)
    with pytest.raises(ValueError, match="runs layers up to 4; the model has 3"):
        _load(path, PipelineStage(1, 2, 2, 4))


def test_an_encoder_decoder_model_is_refused_for_more_than_one_stage(tmp_path: Path) -> None:
    from kvferry_testing.encdec_checkpoints import make_bart_checkpoint

    bart = make_bart_checkpoint(tmp_path / "bart")
    config = ModelArchConfig.from_pretrained(bart)
    check_pipeline_support(config, 1)
    with pytest.raises(ValueError, match="BartForConditionalGeneration is an encoder-decoder "
                                         "model without pipeline parallelism"):
        check_pipeline_support(config, 2)
    with pytest.raises(ValueError, match="without pipeline parallelism"):
        _load(bart, PipelineStage(0, 2, 0, 1))


def test_the_profiling_step_runs_each_stage(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvferry.engine.runner import memory_profile

    path = make_checkpoint(num_layers=3)
    sampled: list[int] = []
    sampler = memory_profile.Sampler

    def counting_sampler() -> object:
        inner = sampler()

        def run(logits: torch.Tensor, metadata: object) -> object:
            sampled.append(logits.shape[0])
            return inner(logits, metadata)
        return run

    monkeypatch.setattr(memory_profile, "Sampler", counting_sampler)
    for stage in pipeline_stages(3, 3):
        model = _load(path, stage)
        shape = (1, stage.num_layers, 2, BLOCK_SIZE, model.config.num_kv_heads,
                 model.config.head_size)
        memory_profile.run_profile_step(
            model, model.config.vocab_size, num_tokens=40, max_num_seqs=8, max_model_len=16,
            block_size=BLOCK_SIZE, kv_cache_shape=shape, dtype=torch.float32,
            device=torch.device("cpu"))
    assert sampled == [8]  # only the last stage computes logits and samples


# ---------------------------------------------------------------------- configuration
@pytest.mark.parametrize(("fields", "message"), [
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be >= 1, got 0"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
    ({"pipeline_parallel_size": 2, "pp_layer_partition": [3]},
     r"pp_layer_partition has 1 entries \(\[3\]\); pipeline_parallel_size is 2"),
    ({"pipeline_parallel_size": 2, "pp_layer_partition": [2, 0]},
     r"pp_layer_partition must hold layer counts >= 1, got \[2, 0\]"),
])
def test_a_bad_parallel_config_is_refused(fields: dict, message: str) -> None:
    from kvferry.engine.config import ParallelConfig

    with pytest.raises(ValueError, match=message):
        ParallelConfig(**fields)


def test_what_a_pipeline_cannot_run_yet_is_refused_before_any_worker_starts(
    make_checkpoint: Callable[..., Path], tmp_path: Path,
) -> None:
    from kvferry.engine.config import EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from kvferry.engine.core.engine_core import EngineCore
    from kvferry_testing.encdec_checkpoints import make_bart_checkpoint

    path = make_checkpoint(num_layers=3)

    def config(model: Path, **fields: object) -> EngineConfig:
        return EngineConfig(model=ModelConfig(model=str(model)), device="cpu",
                            parallel=ParallelConfig(pipeline_parallel_size=2), **fields)

    tensor = EngineConfig(model=ModelConfig(model=str(path)), device="cpu",
                          parallel=ParallelConfig(tensor_parallel_size=2),
                          scheduler=SchedulerConfig(async_scheduling=True))
    with pytest.raises(ValueError, match="async_scheduling with pipeline_parallel_size 1 and "
                                         "tensor_parallel_size 2 is not available yet"):
        EngineCore(tensor)
    bart_tp = EngineConfig(model=ModelConfig(model=str(make_bart_checkpoint(tmp_path / "b"))),
                           device="cpu", parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="BartForConditionalGeneration has no tensor "
                                         "parallelism: tensor_parallel_size must be 1, got 2"):
        EngineCore(bart_tp)
    with pytest.raises(ValueError, match="async_scheduling with pipeline_parallel_size 2 and "
                                         "tensor_parallel_size 1 is not available yet"):
        EngineCore(config(path, scheduler=SchedulerConfig(async_scheduling=True)))
    with pytest.raises(ValueError, match="is an encoder-decoder model without pipeline "
                                         "parallelism"):
        EngineCore(config(make_bart_checkpoint(tmp_path / "bart")))
    too_many = EngineConfig(model=ModelConfig(model=str(path)), device="cpu",
                            parallel=ParallelConfig(pipeline_parallel_size=4))
    with pytest.raises(ValueError, match="cannot split 3 layers over 4 pipeline stages"):
        EngineCore(too_many)
    wrong_sum = EngineConfig(model=ModelConfig(model=str(path)), device="cpu",
                             parallel=ParallelConfig(pipeline_parallel_size=2,
                                                     pp_layer_partition=[2, 2]))
    with pytest.raises(ValueError, match=r"pp_layer_partition \[2, 2\] covers 4 layers; "
                                         "the model has 3"):
        EngineCore(wrong_sum)
