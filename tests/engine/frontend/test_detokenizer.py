import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvferry.engine.frontend.detokenizer import IncrementalDetokenizer
from kvferry.engine.sampling_params import SamplingParams

CORPUS = [
    "héllo wörld, naïve café! 你好，世界。 emoji 🙂🚀 ok",
    "the quick brown fox jumps over the lazy dog; Grüße aus Köln ÄÖÜ",
    "日本語のテキストも少し。 Ελληνικά κείμενα. Русский текст.",
]
PIECES = ["Hel", "lo", " wor", "ld", "!", "#", "a", "b", "c", " ", "</s>", "<eos>"]


def byte_level_tokenizer() -> Tokenizer:
    """A small byte-level BPE trained here: multi-byte characters span several tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 10, trainer)
    return tokenizer


def piece_tokenizer() -> Tokenizer:
    """Word-level over fixed pieces, decoded by plain concatenation (exact boundaries)."""
    tokenizer = Tokenizer(models.WordLevel({p: i for i, p in enumerate(PIECES)}, unk_token="a"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<eos>"])
    return tokenizer


def ids(*pieces: str) -> list[int]:
    return [PIECES.index(p) for p in pieces]


BYTE_LEVEL = byte_level_tokenizer()
PIECE = piece_tokenizer()


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call received."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decode_lengths: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decode_lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def feed_one_by_one(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    texts = []
    for token_id in token_ids:
        detok.update([token_id])
        texts.append(detok.output_text)
    return texts


@pytest.mark.parametrize("seed", range(20))
def test_incremental_text_equals_full_decode_for_random_tokens(seed: int) -> None:
    rng = random.Random(seed)
    prompt = BYTE_LEVEL.encode("the fox").ids
    output = [rng.randrange(BYTE_LEVEL.get_vocab_size()) for _ in range(60)]
    detok = IncrementalDetokenizer(BYTE_LEVEL, prompt, SamplingParams())
    texts = feed_one_by_one(detok, output)
    full = BYTE_LEVEL.decode(output)
    # Only an incomplete character at the very end may still be held back.
    assert detok.output_text == full.rstrip("\ufffd")
    assert all(full.startswith(text) for text in texts)


@pytest.mark.parametrize("text", CORPUS)
def test_multi_byte_characters_never_produce_replacement_chars(text: str) -> None:
    token_ids = BYTE_LEVEL.encode(text).ids
    # The test is only meaningful if some character is split across tokens.
    assert any("\ufffd" in BYTE_LEVEL.decode([t]) for t in token_ids)
    detok = IncrementalDetokenizer(BYTE_LEVEL, [], SamplingParams())
    texts = feed_one_by_one(detok, token_ids)
    assert all("\ufffd" not in t for t in texts)
    assert detok.output_text == text


def test_update_with_several_tokens_at_once_matches_one_by_one() -> None:
    token_ids = BYTE_LEVEL.encode(CORPUS[0]).ids
    detok = IncrementalDetokenizer(BYTE_LEVEL, [], SamplingParams())
    for start in range(0, len(token_ids), 3):
        detok.update(token_ids[start : start + 3])
    assert detok.output_text == CORPUS[0]


def test_decode_window_stays_short_as_output_grows() -> None:
    counting = CountingTokenizer(BYTE_LEVEL)
    prompt = BYTE_LEVEL.encode("the quick brown fox jumps").ids
    detok = IncrementalDetokenizer(counting, prompt, SamplingParams())
    token_ids = BYTE_LEVEL.encode(" over the lazy dog" * 20).ids
    feed_one_by_one(detok, token_ids)
    assert detok.output_text == " over the lazy dog" * 20
    # Five prompt tokens of context plus the first output token, then two-token windows.
    assert max(counting.decode_lengths) == 6
    assert max(counting.decode_lengths[10:]) == 2


def test_word_level_spacing_comes_from_prompt_context() -> None:
    tokenizer = Tokenizer(
        models.WordLevel({"hello": 0, "the": 1, "cat": 2, "[UNK]": 3}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    detok = IncrementalDetokenizer(tokenizer, [0], SamplingParams())
    assert feed_one_by_one(detok, [1, 2]) == [" the", " the cat"]


def test_special_tokens_skipped_or_kept() -> None:
    token_ids = ids("Hel", "<eos>", "lo")
    skipped = IncrementalDetokenizer(PIECE, [], SamplingParams())
    skipped.update(token_ids)
    kept = IncrementalDetokenizer(PIECE, [], SamplingParams(skip_special_tokens=False))
    kept.update(token_ids)
    assert skipped.output_text == "Hello"
    assert kept.output_text == "Hel<eos>lo"


def test_stop_string_cuts_output() -> None:
    detok = IncrementalDetokenizer(PIECE, [], SamplingParams(stop=["wor"]))
    assert detok.update(ids("Hel", "lo")) is None
    assert detok.update(ids(" wor")) == "wor"
    assert detok.output_text == "Hello "


def test_stop_string_kept_with_include_stop_str_in_output() -> None:
    params = SamplingParams(stop=["wor"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(PIECE, [], params)
    assert detok.update(ids("Hel", "lo", " wor", "ld")) == "wor"
    assert detok.output_text == "Hello wor"


def test_stop_string_spanning_two_tokens() -> None:
    detok = IncrementalDetokenizer(PIECE, [], SamplingParams(stop=["lo w"]))
    assert detok.update(ids("Hel")) is None
    assert detok.update(ids("lo")) is None
    assert detok.update(ids(" wor")) == "lo w"
    assert detok.output_text == "Hel"


def test_earliest_stop_string_wins() -> None:
    detok = IncrementalDetokenizer(PIECE, [], SamplingParams(stop=["ld", "lo"]))
    assert detok.update(ids("Hel", "lo", " wor", "ld")) == "lo"
    assert detok.output_text == "Hel"


def test_stop_strings_ignored_until_min_tokens() -> None:
    detok = IncrementalDetokenizer(PIECE, [], SamplingParams(stop=["a"], min_tokens=2))
    assert detok.update(ids("a")) is None
    assert detok.update(ids("b")) is None
    assert detok.update(ids("a")) == "a"
    assert detok.output_text == "ab"


def test_stop_terminated_token_text_left_out_unless_included() -> None:
    plain = IncrementalDetokenizer(PIECE, [], SamplingParams())
    plain.update(ids("a", "</s>"), stop_terminated=True)
    included = IncrementalDetokenizer(
        PIECE, [], SamplingParams(include_stop_str_in_output=True)
    )
    included.update(ids("a", "</s>"), stop_terminated=True)
    assert plain.output_text == "a"
    assert included.output_text == "a</s>"


def test_streaming_holds_back_a_possible_stop_prefix() -> None:
    detok = IncrementalDetokenizer(PIECE, [], SamplingParams(stop=["###"]))
    deltas = []
    for piece in ["a", "#", "#", "b", "#", "#"]:
        assert detok.update(ids(piece)) is None
        deltas.append(detok.get_delta(finished=False))
    assert deltas == ["", "", "a", "#", "#", "b"]
    assert detok.update(ids("#")) == "###"
    assert detok.get_delta(finished=True) == ""
    assert "".join(deltas) == detok.output_text == "a##b"


def test_streaming_without_stops_sends_everything() -> None:
    detok = IncrementalDetokenizer(PIECE, [], SamplingParams())
    detok.update(ids("Hel", "lo"))
    assert detok.get_delta(finished=False) == "Hello"
    detok.update(ids("!"))
    assert detok.get_delta(finished=True) == "!"


@pytest.mark.parametrize("seed", range(30))
def test_streamed_text_is_always_a_prefix_of_the_final_text(seed: int) -> None:
    rng = random.Random(seed)
    params = SamplingParams(stop=["##a", "b#c", "lo w"], max_tokens=None)
    detok = IncrementalDetokenizer(PIECE, [], params)
    streamed = ""
    snapshots = []
    for _ in range(40):
        stop = detok.update(ids(rng.choice(PIECES[:10])))
        streamed += detok.get_delta(finished=stop is not None)
        snapshots.append(streamed)
        if stop is not None:
            break
    else:
        streamed += detok.get_delta(finished=True)
    assert streamed == detok.output_text
    assert all(detok.output_text.startswith(s) for s in snapshots)
    assert not any(s in detok.output_text for s in params.stop)
