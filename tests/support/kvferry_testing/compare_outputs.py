"""Comparing two engines' request outputs: the same tokens, texts, finish and stop reasons,
cached-token counts and errors; logprobs with the same tokens and ranks and values equal up
to float32 rounding (the two engines batch the requests differently)."""

from __future__ import annotations

import math

from kvferry.engine.frontend.outputs import RequestOutput


def logprob_values(entries: list | None) -> list:
    """Per position: its (token, rank, logprob) entries in token order, or None."""
    return [] if entries is None else [
        None if e is None else sorted((t, p.rank, p.logprob) for t, p in e.items())
        for e in entries]


def assert_logprobs_close(got: list, want: list, req_id: str) -> None:
    """Same tokens and ranks; values equal up to float32 rounding."""
    assert len(got) == len(want), req_id
    for got_pos, want_pos in zip(got, want, strict=True):
        if want_pos is None:
            assert got_pos is None, req_id
            continue
        assert [(t, r) for t, r, _ in got_pos] == [(t, r) for t, r, _ in want_pos], req_id
        for (_, _, a), (_, _, b) in zip(got_pos, want_pos, strict=True):
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4), (req_id, a, b)


def assert_same_output(got: RequestOutput, want: RequestOutput, req_id: str,
                       cached_tokens: bool = True) -> None:
    """One request's final outputs agree (`cached_tokens`: its prefix-cache hits too)."""
    assert got.finished and want.finished, req_id
    assert got.error == want.error, req_id
    if cached_tokens:
        assert got.num_cached_tokens == want.num_cached_tokens, req_id
    for want_c, got_c in zip(want.outputs, got.outputs, strict=True):
        assert got_c.token_ids == want_c.token_ids, (req_id, want_c.index)
        assert (got_c.text, got_c.finish_reason, got_c.stop_reason) == (
            want_c.text, want_c.finish_reason, want_c.stop_reason), req_id
        assert_logprobs_close(logprob_values(got_c.logprobs),
                              logprob_values(want_c.logprobs), req_id)
    assert_logprobs_close(logprob_values(got.prompt_logprobs),
                          logprob_values(want.prompt_logprobs), req_id)


def assert_same_outputs(expected: dict[str, RequestOutput],
                        actual: dict[str, RequestOutput]) -> None:
    """Every request of `expected` is in `actual` and agrees with it, and no other is."""
    assert sorted(actual) == sorted(expected)
    for req_id, want in expected.items():
        assert_same_output(actual[req_id], want, req_id)
