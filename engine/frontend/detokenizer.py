"""Incremental detokenization and stop-string detection for one request.

Decoding the whole output every step costs O(length) per step, and decoding each new token
alone is wrong: byte-level tokens can split a UTF-8 character, and tokenizers that join
words with spaces or strip prefixes need the preceding token as context. The detokenizer
decodes only a short window `token_ids[prefix_offset:]`, where `token_ids[prefix_offset:
read_offset]` is context whose text was already emitted, and emits what the window adds to
the context's text, up to the last complete character. Worked example, word-level
tokenizer that joins words with spaces, output so far "a b", new token "c":

    window = ["b", "c"] -> "b c";  context = ["b"] -> "b";  emitted: " c"

Text ending in U+FFFD (an incomplete multi-byte character) is held back until a later
token completes it; once the window ends on a complete character, both offsets advance,
so the window stays a few tokens long however long the output grows.
"""

from __future__ import annotations

from typing import Protocol

from kvferry.engine.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token, so the first output
# token is decoded the way it joins the prompt (leading spaces, merged prefixes).
NUM_PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class TextDecoder(Protocol):
    """What the detokenizer needs from a tokenizer (`tokenizers.Tokenizer` fits)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's sampled tokens into text, step by step, and finds stop strings."""

    def __init__(
        self, tokenizer: TextDecoder, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        # Prompt tail followed by every output token; only the tail window is ever decoded.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_output_tokens = 0
        # token_ids[prefix_offset:read_offset] is context whose text was already emitted.
        self.prefix_offset = max(len(prompt_token_ids) - NUM_PROMPT_CONTEXT_TOKENS, 0)
        self.read_offset = len(prompt_token_ids)
        # Characters of the current window's new text already emitted (the window has not
        # ended on a complete character yet, so the offsets could not advance).
        self._num_window_chars_emitted = 0
        self._output_text = ""
        # Where the next get_delta starts.
        self._num_chars_streamed = 0
        self._stop_strings: list[str] = list(params.stop)
        self._max_stop_len = max((len(s) for s in self._stop_strings), default=0)
        # The stop string that ended generation, once one has matched.
        self.matched_stop: str | None = None

    @property
    def output_text(self) -> str:
        """The output decoded so far (truncated at a matched stop string)."""
        return self._output_text

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append sampled tokens, extend `output_text`, and check stop strings.

        `stop_terminated` says the last token ended generation (EOS or a stop token id); its
        text is then left out unless `include_stop_str_in_output`. Returns the stop string
        that matched in the newly added text (output_text is then cut at it, or just after
        it with include_stop_str_in_output), else None.
        """
        if self.matched_stop is not None:
            return self.matched_stop
        self.num_output_tokens += len(new_token_ids)
        if stop_terminated and new_token_ids and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        num_chars_before = len(self._output_text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self._output_text += self._decode_next()
        # Stop strings count only once min_tokens outputs exist, as for stop token ids.
        if not self._stop_strings or self.num_output_tokens <= self.params.min_tokens:
            return None
        return self._check_stop_strings(num_chars_before)

    def get_delta(self, finished: bool) -> str:
        """Text added since the last call, for streaming.

        While not finished, the last (longest stop string - 1) characters are held back: they
        could be the start of a stop string that the next tokens complete and that must then
        never have been sent.
        """
        end = len(self._output_text)
        if not finished and self._max_stop_len > 1:
            end = max(end - (self._max_stop_len - 1), self._num_chars_streamed)
        delta = self._output_text[self._num_chars_streamed : end]
        self._num_chars_streamed = end
        return delta

    def _decode_next(self) -> str:
        """The text the newest token adds, up to the last complete character."""
        skip = self.params.skip_special_tokens
        context_text = self.tokenizer.decode(
            self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip
        )
        window_text = self.tokenizer.decode(
            self.token_ids[self.prefix_offset :], skip_special_tokens=skip
        )
        new_text = window_text[len(context_text) :]
        complete_text = new_text.rstrip(REPLACEMENT_CHAR)
        emitted = complete_text[self._num_window_chars_emitted :]
        if len(complete_text) == len(new_text) and len(window_text) > len(context_text):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self._num_window_chars_emitted = 0
        else:
            self._num_window_chars_emitted = len(complete_text)
        return emitted

    def _check_stop_strings(self, num_chars_before: int) -> str | None:
        """Find the earliest stop string that ends in the text added by this update."""
        text = self._output_text
        best_index = -1
        best_stop = None
        for stop in self._stop_strings:
            # A match must end after num_chars_before, so it starts at most this far back.
            index = text.find(stop, max(num_chars_before - len(stop) + 1, 0))
            if index != -1 and (best_stop is None or index < best_index):
                best_index, best_stop = index, stop
        if best_stop is None:
            return None
        end = best_index + len(best_stop) if self.params.include_stop_str_in_output else best_index
        self._output_text = text[:end]
        self.matched_stop = best_stop
        return best_stop
