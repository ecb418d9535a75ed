import pytest
import torch
from kvferry.engine.sample.penalties import apply_penalties, block_tokens, token_counts

VOCAB = 5
PAD = VOCAB
# One hand-made row: token 0 is in the prompt, token 1 occurs twice and token 2 once in
# the output, tokens 3 and 4 are unseen.
LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0]
PROMPT = [[0, PAD]]
OUTPUT = [[1, 1, 2]]


def penalize(presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0) -> list:
    logits = torch.tensor([LOGITS])
    result = apply_penalties(
        logits,
        torch.tensor(PROMPT),
        torch.tensor(OUTPUT),
        torch.tensor([presence]),
        torch.tensor([frequency]),
        torch.tensor([repetition]),
    )
    assert logits.tolist() == [LOGITS]
    return result[0].tolist()


def test_token_counts_ignore_padding() -> None:
    counts = token_counts(torch.tensor([[1, 1, 2, PAD], [4, PAD, PAD, PAD]]), VOCAB)
    assert counts.tolist() == [[0, 2, 1, 0, 0, 1], [0, 0, 0, 0, 1, 3]]


def test_repetition_divides_positive_and_multiplies_negative_seen_logits() -> None:
    # 0: prompt, 2.0 / 2;  1: output, -1.0 * 2;  2: output, 0.5 / 2;  3, 4 unseen.
    assert penalize(repetition=2.0) == [1.0, -2.0, 0.25, 3.0, -2.0]


def test_repetition_below_one_boosts_seen_tokens() -> None:
    assert penalize(repetition=0.5) == [4.0, -0.5, 1.0, 3.0, -2.0]


def test_frequency_subtracts_per_occurrence_in_output_only() -> None:
    assert penalize(frequency=0.5) == [2.0, -2.0, 0.0, 3.0, -2.0]


def test_presence_subtracts_once_for_tokens_in_output_only() -> None:
    assert penalize(presence=0.25) == [2.0, -1.25, 0.25, 3.0, -2.0]


def test_all_three_penalties_compose_in_order() -> None:
    # token 1: -1 * 2 = -2, - 0.5 * 2 = -3, - 0.25 = -3.25
    # token 2: 0.5 / 2 = 0.25, - 0.5 * 1 = -0.25, - 0.25 = -0.5
    assert penalize(presence=0.25, frequency=0.5, repetition=2.0) == [
        1.0,
        -3.25,
        -0.5,
        3.0,
        -2.0,
    ]


def test_negative_penalties_encourage_repeats() -> None:
    assert penalize(presence=-1.0, frequency=-0.5) == [2.0, 1.0, 2.0, 3.0, -2.0]


def test_rows_with_neutral_values_are_unchanged() -> None:
    logits = torch.tensor([LOGITS, LOGITS])
    result = apply_penalties(
        logits,
        torch.tensor([[0, PAD], [0, 3]]),
        torch.tensor([[1, 1, 2], [1, 1, 2]]),
        torch.tensor([0.25, 0.0]),
        torch.tensor([0.5, 0.0]),
        torch.tensor([2.0, 1.0]),
    )
    assert result.tolist() == [[1.0, -3.25, -0.5, 3.0, -2.0], LOGITS]


def test_penalties_without_prompt_tensor_skip_repetition() -> None:
    result = apply_penalties(
        torch.tensor([LOGITS]),
        None,
        torch.tensor(OUTPUT),
        torch.tensor([0.0]),
        torch.tensor([1.0]),
        torch.tensor([1.0]),
    )
    assert result[0].tolist() == [2.0, -3.0, -0.5, 3.0, -2.0]


def test_block_tokens_sets_pairs_to_minus_inf() -> None:
    logits = torch.zeros(2, VOCAB)
    result = block_tokens(logits, torch.tensor([0, 0, 1]), torch.tensor([4, 1, 4]))
    inf = float("-inf")
    assert result.tolist() == [[0.0, inf, 0.0, 0.0, inf], [0.0, 0.0, 0.0, 0.0, inf]]
    assert logits.tolist() == [[0.0] * VOCAB] * 2


@pytest.mark.parametrize("repetition", [1.0, 1.7])
def test_unseen_tokens_never_change(repetition: float) -> None:
    assert penalize(presence=1.0, frequency=1.0, repetition=repetition)[3:] == [3.0, -2.0]
