import math

import pytest
import torch
from kvferry.engine.sample.metadata import SamplingMetadata
from kvferry.engine.sample.sampler import Sampler, SamplerOutput
from kvferry.engine.sample.seeded_noise import exponential_of_top_bits, seeded_exponential_noise
from kvferry.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def make_logits(num_rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * 3.0


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    block: dict[int, list[int]] | None = None,
) -> SamplerOutput:
    metadata = SamplingMetadata.build(
        params=params,
        output_token_ids=outputs if outputs is not None else [[] for _ in params],
        prompt_token_ids=prompts if prompts is not None else [[] for _ in params],
        stop_token_ids_to_block=block or {},
        vocab_size=logits.shape[1],
        device=CPU,
    )
    return Sampler()(logits, metadata)


def test_greedy_equals_argmax() -> None:
    logits = make_logits(16, 300)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 16)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, torch.argmax(logits, dim=-1))
    assert out.logprobs is None


def test_greedy_rows_in_a_mixed_batch_equal_argmax() -> None:
    logits = make_logits(6, 300)
    params = [SamplingParams(temperature=0.0 if row % 2 else 1.5) for row in range(6)]
    sampled = sample(logits, params).sampled_token_ids
    assert sampled[1::2].tolist() == torch.argmax(logits[1::2], dim=-1).tolist()


@pytest.mark.parametrize(
    "params", [SamplingParams(top_k=1, temperature=2.0), SamplingParams(top_p=1e-6)]
)
def test_top_k_one_and_tiny_top_p_equal_greedy(params: SamplingParams) -> None:
    logits = make_logits(32, 500, seed=3)
    sampled = sample(logits, [params] * 32).sampled_token_ids
    assert torch.equal(sampled, torch.argmax(logits, dim=-1))


def test_min_p_never_samples_filtered_tokens() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps only tokens 0 and 1.
    row = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    torch.manual_seed(0)
    sampled = sample(torch.tensor([row] * 4000), [SamplingParams(min_p=0.5)] * 4000)
    assert set(sampled.sampled_token_ids.tolist()) == {0, 1}


def test_top_k_never_samples_outside_the_top_k() -> None:
    logits = make_logits(1, 100, seed=5).expand(5000, 100).contiguous()
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    torch.manual_seed(0)
    sampled = sample(logits, [SamplingParams(top_k=5, temperature=3.0)] * 5000)
    assert set(sampled.sampled_token_ids.tolist()) == top5


def test_sampled_frequencies_follow_softmax() -> None:
    row = torch.tensor([[1.0, 2.0, 0.0, -1.0, 1.5]])
    num_draws = 20000
    torch.manual_seed(1)
    sampled = sample(row.expand(num_draws, 5).contiguous(), [SamplingParams()] * num_draws)
    freqs = torch.bincount(sampled.sampled_token_ids, minlength=5).float() / num_draws
    assert torch.allclose(freqs, row[0].softmax(-1), atol=0.015)


def empirical_entropy(tokens: torch.Tensor, vocab_size: int) -> float:
    freqs = torch.bincount(tokens, minlength=vocab_size).float() / tokens.numel()
    freqs = freqs[freqs > 0]
    return float(-(freqs * freqs.log()).sum())


def test_temperature_scales_entropy() -> None:
    logits = make_logits(1, 50, seed=2).expand(5000, 50).contiguous()
    entropies = []
    for temperature in (0.3, 1.0, 3.0):
        torch.manual_seed(0)
        out = sample(logits, [SamplingParams(temperature=temperature)] * 5000)
        entropies.append(empirical_entropy(out.sampled_token_ids, 50))
    assert entropies[0] < entropies[1] < entropies[2]


def run_steps(
    params: list[SamplingParams], row_of_interest: int, num_steps: int, vocab_size: int = 1000
) -> list[int]:
    """Sample `num_steps` steps with flat logits, each row's outputs growing as it samples."""
    logits = torch.zeros(len(params), vocab_size)
    outputs: list[list[int]] = [[] for _ in params]
    for _ in range(num_steps):
        out = sample(logits, params, outputs=outputs)
        for row, token in enumerate(out.sampled_token_ids.tolist()):
            outputs[row].append(token)
    return outputs[row_of_interest]


def test_seeded_row_is_reproducible_alone_and_in_any_batch() -> None:
    seeded = SamplingParams(seed=1234)
    alone = run_steps([seeded], 0, 10)
    torch.manual_seed(99)
    batched = run_steps(
        [SamplingParams(), SamplingParams(temperature=0.0), seeded, SamplingParams(seed=7)], 2, 10
    )
    torch.manual_seed(5)
    batched_other_row = run_steps([SamplingParams(top_k=3), seeded], 1, 10)
    assert alone == batched == batched_other_row
    assert len(set(alone)) > 1


def test_different_seeds_give_different_tokens() -> None:
    first = run_steps([SamplingParams(seed=1)], 0, 10)
    second = run_steps([SamplingParams(seed=2)], 0, 10)
    assert first != second


def test_n_children_with_cloned_seeds_differ_and_reproduce() -> None:
    parent = SamplingParams(n=3, seed=42)
    children = [parent.clone_for_child(i) for i in range(3)]
    per_child = [run_steps(children, row, 8) for row in range(3)]
    assert per_child[0] != per_child[1] != per_child[2]
    assert per_child[1] == run_steps([children[1]], 0, 8)


def test_min_tokens_blocking_removes_eos_from_greedy_and_random_rows() -> None:
    eos = 3
    logits = torch.zeros(2, 6)
    logits[:, eos] = 10.0
    logits[:, 1] = 5.0
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)]
    torch.manual_seed(0)
    for _ in range(50):
        out = sample(logits, params, block={0: [eos], 1: [eos, 1]})
        assert out.sampled_token_ids[0].item() == 1
        assert out.sampled_token_ids[1].item() not in (eos, 1)
    unblocked = sample(logits, [SamplingParams(temperature=0.0)] * 2)
    assert unblocked.sampled_token_ids.tolist() == [eos, eos]


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.5, -1.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    # Token 0 was in the prompt: 2.0 / 2 = 1.0 < 1.5.
    out = sample(logits, params, prompts=[[0]], outputs=[[]])
    assert out.sampled_token_ids.tolist() == [1]


def test_frequency_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.5, -1.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.3)]
    # Token 0 occurred twice in the output: 2.0 - 0.6 = 1.4 < 1.5.
    out = sample(logits, params, outputs=[[0, 0]])
    assert out.sampled_token_ids.tolist() == [1]


def test_logprobs_are_raw_log_softmax_with_sampled_token_first() -> None:
    logits = make_logits(4, 40, seed=8)
    params = [
        SamplingParams(logprobs=3, temperature=0.7, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(logprobs=1, top_k=10),
        SamplingParams(logprobs=0, seed=3),
    ]
    out = sample(logits, params, outputs=[[1, 2], [3], [], [5]], prompts=[[4], [], [], []])
    expected = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    lp = out.logprobs
    assert lp.token_ids.shape == (4, 4) and lp.logprobs.shape == (4, 4)
    assert lp.token_ids[:, 0].tolist() == sampled.tolist()
    assert torch.equal(lp.logprobs[:, 0], expected.gather(1, sampled[:, None])[:, 0])
    top = torch.topk(expected, 3, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    assert torch.equal(lp.logprobs[:, 1:], top.values)
    order = torch.argsort(expected, dim=-1, descending=True)
    ranks = [order[row].tolist().index(sampled[row].item()) + 1 for row in range(4)]
    assert lp.ranks.tolist() == ranks


def test_logprobs_zero_returns_only_sampled_token() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=0)])
    assert out.logprobs.token_ids.tolist() == [[2]]
    assert out.logprobs.ranks.tolist() == [1]
    assert out.logprobs.logprobs[0, 0].item() == pytest.approx(
        2.0 - math.log(1 + math.e + math.e**2)
    )


def test_sampler_leaves_input_logits_unchanged() -> None:
    logits = make_logits(3, 20)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.5, top_p=0.5, min_p=0.1, repetition_penalty=1.4),
        SamplingParams(temperature=0.0, frequency_penalty=1.0),
        SamplingParams(top_k=2),
    ]
    sample(logits, params, outputs=[[1], [2], [3]], prompts=[[4], [5], [6]], block={0: [0]})
    assert torch.equal(logits, before)


def test_sampler_rejects_mismatched_logits() -> None:
    metadata = SamplingMetadata.build([SamplingParams()], [[]], [[]], {}, 10, CPU)
    with pytest.raises(ValueError, match=r"^logits have 2 rows, but metadata.num_rows is 1$"):
        Sampler()(torch.zeros(2, 10), metadata)
    message = r"^logits have 11 columns, but metadata.vocab_size is 10$"
    with pytest.raises(ValueError, match=message):
        Sampler()(torch.zeros(1, 11), metadata)


def test_seeded_noise_is_a_function_of_seed_step_and_token_alone() -> None:
    seeds = torch.tensor([5, 5, -3, 2**62], dtype=torch.int64)
    steps = torch.tensor([0, 1, 0, 9], dtype=torch.int64)
    batch = seeded_exponential_noise(seeds, steps, 300)
    # Row by row, in another order, with another vocabulary width: the same numbers.
    for row in (3, 0, 2, 1):
        alone = seeded_exponential_noise(seeds[row : row + 1], steps[row : row + 1], 500)
        assert torch.equal(alone[0, :300], batch[row])
    assert not torch.equal(batch[0], batch[1])  # the step moves the stream on


def test_seeded_noise_is_exponential_with_rate_one() -> None:
    noise = seeded_exponential_noise(torch.arange(4), torch.zeros(4, dtype=torch.int64), 250_000)
    assert bool((noise > 0).all())
    for row in noise:
        assert abs(float(row.mean()) - 1.0) < 0.01
        assert abs(float(row.var()) - 1.0) < 0.02
        # P(E > 2) = e^-2
        assert abs(float((row > 2).float().mean()) - math.exp(-2)) < 0.003


def test_the_largest_uniform_still_gives_positive_noise() -> None:
    # (2^24 - 1 + 0.5) / 2^24 rounds to 1.0 in float32; its noise must not be -log(1) = 0,
    # or a token of probability 0 scores 0 / 0 = NaN and wins the race.
    top = torch.tensor([0, 1, 2**23, 2**24 - 2, 2**24 - 1])
    noise = exponential_of_top_bits(top)
    assert bool((noise > 0).all()), noise
    assert noise[-1].item() == 2.0**-25 and noise[-2].item() >= 2.0**-24
    probs = torch.tensor([[0.0, 1.0]])
    assert (probs / torch.stack([noise[-1], noise[0]])[None]).argmax().item() == 1


def test_seeded_rows_sample_their_probabilities() -> None:
    """Many seeds over one distribution: token frequencies follow the probabilities."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    logits = probs.log().expand(20_000, 5).contiguous()
    params = [SamplingParams(seed=seed) for seed in range(20_000)]
    counts = torch.bincount(sample(logits, params).sampled_token_ids, minlength=5).float()
    assert torch.allclose(counts / 20_000, probs, atol=0.01), counts / 20_000


def test_logit_bias_of_100_makes_greedy_and_random_rows_sample_that_token() -> None:
    logits = make_logits(6, 300)
    params = [SamplingParams(temperature=t, logit_bias={17: 100.0}) for t in (0.0, 1.0, 2.0)]
    params += [SamplingParams(temperature=t) for t in (0.0, 1.0, 2.0)]
    for _ in range(5):
        sampled = sample(logits, params).sampled_token_ids
        assert sampled[:3].tolist() == [17, 17, 17]
        # Rows without a bias are untouched: the greedy one still takes the argmax.
        assert sampled[3] == torch.argmax(logits[3])


def test_logit_bias_adds_to_each_named_token_and_minus_100_bans_it() -> None:
    logits = make_logits(2, 50)
    top = int(torch.argmax(logits[0]))
    runner_up = int(logits[0].topk(2).indices[1])
    bias = {top: -100.0, runner_up: 0.5}
    metadata = SamplingMetadata.build([SamplingParams(temperature=0.0, logit_bias=bias),
                                       SamplingParams(temperature=0.0)],
                                      [[], []], [[], []], {}, 50, CPU)
    processed = Sampler().apply_logits_processors(logits.clone(), metadata)
    expected = logits.clone()
    expected[0, top] -= 100.0
    expected[0, runner_up] += 0.5
    assert torch.equal(processed, expected)
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [
        runner_up, int(torch.argmax(logits[1]))]


def test_allowed_token_ids_restrict_only_their_row() -> None:
    logits = make_logits(3, 400)
    allowed = [3, 250, 399]
    params = [SamplingParams(temperature=1.5, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0, allowed_token_ids=[7]),
              SamplingParams(temperature=0.0)]
    seen = set()
    for _ in range(200):
        sampled = sample(logits, params).sampled_token_ids.tolist()
        assert sampled[0] in allowed and sampled[1] == 7
        assert sampled[2] == int(torch.argmax(logits[2]))
        seen.add(sampled[0])
    assert len(seen) >= 2  # still sampled among the allowed, not pinned to one


def test_token_constraints_leave_input_logits_unchanged_and_logprobs_raw() -> None:
    logits = make_logits(2, 64)
    original = logits.clone()
    params = [SamplingParams(temperature=0.0, logprobs=0, logit_bias={5: 100.0}),
              SamplingParams(temperature=0.0, logprobs=0, allowed_token_ids=[9])]
    out = sample(logits, params)
    assert torch.equal(logits, original)
    assert out.sampled_token_ids.tolist() == [5, 9]
    assert out.logprobs is not None
    raw = original.log_softmax(dim=-1)
    assert torch.allclose(out.logprobs.logprobs[:, 0], raw[[0, 1], [5, 9]])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"logit_bias": {3: 100.5}}, "logit_bias[3] must be in [-100, 100]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias token ids must be >= 0"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "more than the limit of 1024"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids[1] must be >= 0"),
])
def test_token_constraint_values_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        SamplingParams(**kwargs)
    assert message in str(caught.value)


def test_constraint_token_ids_outside_the_vocabulary_are_refused_by_metadata() -> None:
    with pytest.raises(ValueError, match="logit_bias has token id 64"):
        SamplingMetadata.build([SamplingParams(logit_bias={64: 1.0})], [[]], [[]], {}, 64, CPU)
    with pytest.raises(ValueError, match="allowed_token_ids has token id 70"):
        SamplingMetadata.build([SamplingParams(allowed_token_ids=[70])], [[]], [[]], {}, 64, CPU)
