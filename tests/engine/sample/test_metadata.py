import re

import pytest
import torch
from kvferry.engine.sample.metadata import SamplingMetadata
from kvferry.engine.sampling_params import SamplingParams

VOCAB = 10
CPU = torch.device("cpu")


def build(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    block: dict[int, list[int]] | None = None,
) -> SamplingMetadata:
    return SamplingMetadata.build(
        params=params,
        output_token_ids=outputs if outputs is not None else [[] for _ in params],
        prompt_token_ids=prompts if prompts is not None else [[1] for _ in params],
        stop_token_ids_to_block=block or {},
        vocab_size=VOCAB,
        device=CPU,
    )


def test_all_greedy_fast_path_builds_no_tensors() -> None:
    metadata = build([SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 3)
    assert metadata.all_greedy and not metadata.all_random
    assert metadata.is_greedy is None
    assert metadata.temperature is None
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.no_penalties
    assert metadata.output_token_ids is None and metadata.prompt_token_ids is None
    assert metadata.max_num_logprobs is None
    assert metadata.blocked_rows is None and metadata.blocked_token_ids is None


def test_all_random_plain_rows_build_only_temperature() -> None:
    metadata = build([SamplingParams(temperature=0.5), SamplingParams(top_k=-1)])
    assert metadata.all_random and not metadata.all_greedy
    assert metadata.is_greedy is None
    assert metadata.temperature.tolist() == [0.5, 1.0]
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None


def test_mixed_rows_switch_filters_off_for_greedy_rows() -> None:
    params = [
        SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.5),
        SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.1),
        SamplingParams(top_k=50),
    ]
    metadata = build(params)
    assert metadata.is_greedy.tolist() == [True, False, False]
    assert metadata.temperature.tolist() == pytest.approx([1.0, 0.8, 1.0])
    # Row 2's top_k exceeds the vocabulary, so it is clamped to "off" (= VOCAB).
    assert metadata.top_k.tolist() == [VOCAB, 3, VOCAB]
    assert metadata.max_top_k == 3
    assert metadata.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert metadata.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0])


def test_top_k_at_or_above_vocab_is_off() -> None:
    assert build([SamplingParams(top_k=VOCAB)]).top_k is None


def test_penalty_tensors_are_padded_with_vocab_size() -> None:
    params = [SamplingParams(frequency_penalty=0.5), SamplingParams()]
    metadata = build(params, outputs=[[3, 4, 3], [7]], prompts=[[1, 2], [5]])
    assert not metadata.no_penalties
    assert metadata.output_token_ids.tolist() == [[3, 4, 3], [7, VOCAB, VOCAB]]
    assert metadata.frequency_penalties.tolist() == [0.5, 0.0]
    assert metadata.repetition_penalties.tolist() == [1.0, 1.0]
    # Only the repetition penalty reads the prompt.
    assert metadata.prompt_token_ids is None


def test_prompt_tensor_built_for_repetition_penalty() -> None:
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.3)]
    metadata = build(params, outputs=[[], []], prompts=[[1, 2, 3], [4]])
    assert metadata.prompt_token_ids.tolist() == [[1, 2, 3], [4, VOCAB, VOCAB]]
    assert metadata.output_token_ids.shape == (2, 0)


def test_max_num_logprobs_is_max_over_rows() -> None:
    params = [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=5)]
    assert build(params).max_num_logprobs == 5
    assert build([SamplingParams(logprobs=0)]).max_num_logprobs == 0


def test_blocked_pairs_are_flattened_in_row_order() -> None:
    metadata = build([SamplingParams()] * 3, block={0: [9, 2], 2: [9], 1: []})
    assert metadata.blocked_rows.tolist() == [0, 0, 2]
    assert metadata.blocked_token_ids.tolist() == [9, 2, 9]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"outputs": [[]]}, "output_token_ids must have one list per row (2), got 1"),
        ({"prompts": [[1]] * 3}, "prompt_token_ids must have one list per row (2), got 3"),
        ({"block": {-1: [1]}}, "stop_token_ids_to_block has row -1, but rows must be in [0, 2)"),
        (
            {"block": {0: [VOCAB]}},
            f"stop_token_ids_to_block has token id {VOCAB}, but ids must be in [0, {VOCAB})",
        ),
    ],
)
def test_build_rejects_inconsistent_inputs(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build([SamplingParams()] * 2, **kwargs)


def test_token_constraints_are_built_only_for_rows_that_have_them() -> None:
    plain = SamplingMetadata.build([SamplingParams(), SamplingParams(temperature=0.0)],
                                   [[], []], [[], []], {}, 32, torch.device("cpu"))
    assert (plain.bias_rows, plain.allowed_rows, plain.allowed_mask) == (None, None, None)
    mixed = SamplingMetadata.build(
        [SamplingParams(), SamplingParams(logit_bias={4: 2.0, 9: -1.0}),
         SamplingParams(allowed_token_ids=[1, 31])],
        [[], [], []], [[], [], []], {}, 32, torch.device("cpu"))
    assert mixed.bias_rows.tolist() == [1, 1]
    assert mixed.bias_token_ids.tolist() == [4, 9]
    assert mixed.bias_values.tolist() == [2.0, -1.0]
    assert mixed.allowed_rows.tolist() == [2]
    assert mixed.allowed_mask.nonzero().tolist() == [[0, 1], [0, 31]]
