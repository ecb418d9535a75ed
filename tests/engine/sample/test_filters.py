import math

import torch
from kvferry.engine.sample.filters import apply_min_p, apply_top_k_top_p

INF = float("-inf")


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row > INF).flatten().tolist() for row in logits]


def test_min_p_drops_tokens_below_fraction_of_top_probability() -> None:
    # Top probability 0.5: min_p 0.5 keeps p >= 0.25, min_p 0.1 keeps p >= 0.05, 0 keeps all.
    row = log_probs(0.5, 0.3, 0.15, 0.04, 0.01)
    logits = torch.tensor([row, row, row])
    result = apply_min_p(logits, torch.tensor([0.5, 0.1, 0.0]))
    assert kept(result) == [[0, 1], [0, 1, 2], [0, 1, 2, 3, 4]]
    assert result[0, :2].tolist() == logits[0, :2].tolist()


def test_min_p_one_keeps_only_the_top_token() -> None:
    result = apply_min_p(torch.tensor([[0.1, 2.0, 1.9]]), torch.tensor([1.0]))
    assert kept(result) == [[1]]


def test_top_k_only_keeps_k_largest_per_row() -> None:
    logits = torch.tensor([[0.1, 0.9, 0.5, 0.7, 0.3], [5.0, 4.0, 3.0, 2.0, 1.0]])
    # Row 1 has top-k off (= vocab size).
    result = apply_top_k_top_p(logits, torch.tensor([2, 5]), 2, None)
    assert kept(result) == [[1, 3], [0, 1, 2, 3, 4]]
    assert result[0, 1].item() == logits[0, 1].item()


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    # Sorted probabilities 0.5, 0.3, 0.2 (token order 2, 0, 1); masses before: 0, 0.5, 0.8.
    row = log_probs(0.3, 0.2, 0.5)
    logits = torch.tensor([row] * 4)
    result = apply_top_k_top_p(logits, None, 0, torch.tensor([0.4, 0.75, 0.85, 1.0]))
    assert kept(result) == [[2], [0, 2], [0, 1, 2], [0, 1, 2]]


def test_top_p_tiny_keeps_the_top_token() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert kept(apply_top_k_top_p(logits, None, 0, torch.tensor([1e-9]))) == [[1]]


def test_top_k_and_top_p_together_renormalize_after_top_k() -> None:
    # top_k 2 keeps probs 0.4, 0.3 (renormalized 4/7, 3/7); top_p 0.5 then keeps only one.
    row = log_probs(0.4, 0.3, 0.2, 0.1)
    logits = torch.tensor([row, row, row])
    top_k = torch.tensor([2, 4, 2])
    top_p = torch.tensor([0.5, 0.65, 1.0])
    result = apply_top_k_top_p(logits, top_k, 2, top_p)
    assert kept(result) == [[0], [0, 1], [0, 1]]


def test_no_filters_return_the_input() -> None:
    logits = torch.randn(2, 6)
    assert apply_top_k_top_p(logits, None, 0, None) is logits
