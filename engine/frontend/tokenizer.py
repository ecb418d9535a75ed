"""Text <-> token ids from a checkpoint's `tokenizer.json`, without transformers.

`tokenizer.json` holds the whole pipeline (normalizer, pre-tokenizer, model, post
processor, decoder) and the `tokenizers` library runs it; `tokenizer_config.json` adds
the special tokens' names, the decode clean-up flag, and the chat template
(transformers 5 keeps the template in `chat_template.jinja` instead). Whether a BOS is
prepended is the post processor's business, as in transformers' generic fast
tokenizer; `add_bos_token` in the config is not consulted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tokenizers


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config is a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the one called "default" is the chat template.
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default")
    return template


def _clean_up_tokenization(text: str) -> str:
    """The spacing clean-up HF applies when `clean_up_tokenization_spaces` is set."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


# Pre-tokenizers that keep every character of the text (they split it or map it one to one).
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation",
                                     "UnicodeScripts"})


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre_tokenizer.get("pretokenizers", ()))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _has_byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers", ()))
    return pre_tokenizer.get("type") == "ByteLevel"


def _normalizer_never_shrinks(normalizer: dict[str, Any] | None) -> bool:
    """Whether the normalizer leaves at least as many characters as it gets."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_normalizer_never_shrinks(n) for n in normalizer.get("normalizers", ()))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern", {})
        return "String" in pattern and len(normalizer.get("content", "")) >= len(pattern["String"])
    return False


def longest_token_chars(spec: dict[str, Any]) -> int | None:
    """The most characters of text one token can stand for, from a `tokenizer.json`.

    Then a text of C characters has at least C / L tokens, which tells that a prompt is
    too long without tokenizing it. None when no such bound holds: a model other than BPE,
    an unknown character without a byte to fall back to (it may fuse into one unknown
    token), or a normalizer or pre-tokenizer that can drop characters. A byte-level
    token's vocabulary string has one character per byte, so its length bounds the text
    characters it covers; added (special) tokens count with their own text.
    """
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    pre_tokenizer = spec.get("pre_tokenizer")
    if not (model.get("byte_fallback") or _has_byte_level(pre_tokenizer)):
        return None
    if not (_keeps_text(pre_tokenizer) and _normalizer_never_shrinks(spec.get("normalizer"))):
        return None
    lengths = [len(token) for token in model.get("vocab", {})]
    lengths += [len(added.get("content", "")) for added in spec.get("added_tokens", ())]
    return max([1, *lengths])


class Tokenizer:
    """A checkpoint's tokenizer: `encode`, `decode`, its special ids and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        clean_up_tokenization_spaces: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id: int | None = backend.token_to_id(eos_token) if eos_token else None
        # The clean-up strips real spaces before punctuation from BPE output, so (like
        # transformers 5) it only applies to other models, such as WordPiece.
        is_bpe = type(backend.model).__name__ == "BPE"
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces and not is_bpe
        self.chat_template = chat_template
        # Read once here (loading runs off the server's event loop); see longest_token_chars.
        self.max_token_chars = longest_token_chars(json.loads(backend.to_str()))

    @classmethod
    def from_pretrained(cls, model_dir: Path) -> Tokenizer:
        """Loads `model_dir/tokenizer.json` and, when present, `tokenizer_config.json`."""
        import tokenizers

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"{model_dir} has no tokenizer.json; only tokenizers-library (fast) "
                "tokenizers are supported"
            )
        config_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        return cls(
            tokenizers.Tokenizer.from_file(str(path)),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
            chat_template=_read_chat_template(model_dir, config),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special) tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the tokenizer adds them."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_in_thread(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`'s ids, for a worker thread: the tokenizers library lets other threads
        run (releases the GIL) for the whole of a batch encode, but not of a single one, so
        a long text encoded this way does not stall an event loop in another thread."""
        batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return batch[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; special tokens are dropped unless `skip_special_tokens` is False."""
        text = self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            text = _clean_up_tokenization(text)
        return text

    def to_json(self) -> str:
        """The whole `tokenizer.json` pipeline, padding and truncation off (what the grammar
        engine of structured outputs reads)."""
        import copy

        backend = copy.copy(self._backend)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        """The id of `token`, or None when it is not in the vocabulary."""
        return self._backend.token_to_id(token)
