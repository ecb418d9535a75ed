"""Tokenizer equals transformers' AutoTokenizer on the same files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.engine.models.demo import CHAT_TEMPLATE, create_demo_checkpoint
from kvferry.engine.frontend.tokenizer import Tokenizer

TEXTS = [
    "Hello world, this is kvferry!",
    "  two leading spaces\nand a newline 12345",
    "ünïcödé 日本語 emoji 🚀",
    "<|user|>\nhi</s>\n<|assistant|>\n",
    "",
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_demo_checkpoint(tmp_path_factory.mktemp("demo-tok") / "ckpt")


def _auto(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_demo_tokenizer_matches_auto_tokenizer(demo_dir, add_special_tokens):
    ours, theirs = Tokenizer.from_pretrained(demo_dir), _auto(demo_dir)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == theirs.encode(text, add_special_tokens=add_special_tokens), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )


def test_demo_tokenizer_fields(demo_dir):
    tok = Tokenizer.from_pretrained(demo_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 2048)
    assert tok.encode("hi")[0] == 1
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.decode(tok.encode("round trip, 42 times!")) == "round trip, 42 times!"


def test_word_tokenizer_matches_auto_tokenizer(make_checkpoint):
    path = make_checkpoint()
    ours, theirs = Tokenizer.from_pretrained(path), _auto(path)
    text = "w3 w17 w255 unknownword w4"
    assert ours.encode(text) == theirs.encode(text) == [3, 17, 255, 0, 4]
    assert ours.decode([3, 2, 17]) == theirs.decode([3, 2, 17], skip_special_tokens=True)
    assert (ours.bos_token_id, ours.eos_token_id, ours.vocab_size) == (1, 2, 256)
    # transformers 5 writes the template to chat_template.jinja.
    assert (path / "chat_template.jinja").is_file()
    assert ours.chat_template == theirs.chat_template


def _with_clean_up(path: Path, dst: Path) -> Path:
    dst = Path(shutil.copytree(path, dst))
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["clean_up_tokenization_spaces"] = True
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_clean_up_is_skipped_for_bpe(demo_dir, tmp_path):
    path = _with_clean_up(demo_dir, tmp_path / "bpe")
    ours, theirs = Tokenizer.from_pretrained(path), _auto(path)
    ids = ours.encode("Yes , it is . Isn 't it ?")
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == "Yes , it is . Isn 't it ?"


def test_clean_up_applies_to_wordpiece(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {
        w: i for i, w in enumerate(["[UNK]", "[SEP]", "yes", ",", "it", "is", ".", "?", "'", "s"])
    }
    backend = Backend(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[SEP]")
    fast.save_pretrained(str(tmp_path / "wp"))
    path = _with_clean_up(tmp_path / "wp", tmp_path / "wp-clean")
    ours, theirs = Tokenizer.from_pretrained(path), _auto(path)
    ids = ours.encode("yes, it is. it's?")
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == "yes, it is. it's?"


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=400) | st.lists(st.sampled_from(
    ["Hello", " world", "<|user|>", "</s>", "\n", "  ", "🚀", "ü", "the history of"]),
    max_size=60).map("".join))
def test_the_longest_token_bounds_a_texts_token_count(demo_dir, text):
    """No text has fewer tokens than its characters over the longest token's (the bound the
    server uses to refuse a prompt without tokenizing it)."""
    tokenizer = Tokenizer.from_pretrained(demo_dir)
    longest = tokenizer.max_token_chars
    assert longest is not None and longest >= 1
    for add_special_tokens in (True, False):
        num_tokens = len(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        assert num_tokens >= -(-len(text) // longest), (text, num_tokens, longest)


def test_no_length_bound_where_a_token_may_cover_any_number_of_characters(make_checkpoint,
                                                                          demo_dir):
    # A word-level vocabulary maps an unknown word of any length to one token.
    assert Tokenizer.from_pretrained(make_checkpoint(vocab_size=64)).max_token_chars is None
    # A pre-tokenizer that drops whitespace lets any run of spaces cost no token.
    import tokenizers

    backend = tokenizers.Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [tokenizers.pre_tokenizers.WhitespaceSplit(), tokenizers.pre_tokenizers.ByteLevel()])
    assert Tokenizer(backend).max_token_chars is None


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_in_thread_gives_encodes_ids(demo_dir: Path, add_special_tokens: bool) -> None:
    tok = Tokenizer.from_pretrained(demo_dir)
    for text in ["", "Hello", "w5 w6 é 😀 \n\t", "the river " * 500]:
        assert tok.encode_in_thread(text, add_special_tokens) == tok.encode(text,
                                                                            add_special_tokens)
