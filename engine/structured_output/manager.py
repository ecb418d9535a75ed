"""The engine core's side of structured outputs: grammars compiled off the step, one matcher
per request, and each step's token bitmask computed while the model runs.

A constrained request's life in the core:

1. `add_request` hands its constraint to a compile thread (each distinct constraint is
   compiled once, then copied); the request waits, unscheduled, until the grammar is
   ready (vLLM's WAITING_FOR_FSM), so a slow compile holds no step back;
2. `start` gives it its matcher, advanced over any output it already has (none in practice:
   a decode pod samples the first token again from the pulled KV, so its grammar runs from
   the start of the output, as the prefill pod's did);
3. each step that samples it, `start_bitmask` (called right after scheduling) fills its row
   of the step's bitmask on a worker thread while the forward pass runs; the runner waits
   for it just before sampling, and the sampler sets the logits of disallowed tokens to
   -inf (engine/sample/bitmask.py);
4. `accept_token` advances the matcher by the sampled token; when the grammar is complete
   (nothing more may follow) the request ends with finish_reason "stop".

Preemption keeps a request's output, so its matcher stays where it is: the request
recomputes KV, not tokens. A request with no constraint is never seen here, and a step
without a constrained request that samples builds no bitmask: `start_bitmask` is not even
called (the scheduler's list is empty), so unconstrained serving runs exactly as before.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from kvferry.engine.sampling_params import StructuredOutputsParams
from kvferry.engine.structured_output.grammar import GrammarCompiler, read_tokenizer_json

if TYPE_CHECKING:
    import llguidance
    from kvferry.engine.core.request import Request

def num_bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id."""
    return (vocab_size + 31) // 32


def fill_bitmask(executor: llguidance.LLExecutor, matchers: list[llguidance.LLMatcher],
                 buffer: torch.Tensor) -> torch.Tensor:
    """Writes matcher i's allowed tokens into row i of `buffer` ((rows, words) int32, CPU,
    contiguous); returns the rows written. llguidance fills them in parallel threads with
    the GIL released."""
    rows = buffer[: len(matchers)]
    executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], rows.data_ptr(),
                                     rows.shape[1] * rows.element_size(), len(matchers))
    return rows


class RequestGrammar:
    """One request's constraint: compiling, then the matcher its sampled tokens advance."""

    def __init__(self, compiled: Future[llguidance.LLMatcher]) -> None:
        # The compile thread's result: a matcher in the start state, or a ValueError.
        self.compiled = compiled
        self.matcher: llguidance.LLMatcher | None = None

    @property
    def is_compiled(self) -> bool:
        return self.compiled.done()

    def start(self, output_token_ids: list[int]) -> str | None:
        """Takes the compiled matcher and feeds it the output so far; the error, or None."""
        try:
            matcher = self.compiled.result()
        except ValueError as exc:
            return str(exc)
        if output_token_ids and not matcher.consume_tokens(output_token_ids):
            return f"the output so far does not match the constraint: {matcher.get_error()}"
        self.matcher = matcher
        return None


@dataclass
class GrammarBitmask:
    """A step's bitmask, being filled: row i is for `req_ids[i]` (bit t of a row set when
    token t is allowed)."""

    req_ids: list[str]
    _rows: Future[torch.Tensor]

    def result(self) -> torch.Tensor:
        """(len(req_ids), num_words) int32 on the CPU; waits for the fill to end. The rows
        are valid until the next step's bitmask is started (they share one buffer)."""
        return self._rows.result()

    def copy_when_filled(self) -> Future[torch.Tensor]:
        """A copy of the rows taken as soon as they are filled, on the filling thread,
        before the next step's fill reuses the buffer: for an executor that samples after
        later steps were started (a pipeline's last stage). Call it before the next step's
        bitmask is started."""
        copied: Future[torch.Tensor] = Future()

        def copy(filled: Future[torch.Tensor]) -> None:
            try:
                copied.set_result(filled.result().clone())
            except Exception as exc:  # noqa: BLE001 - the fill's failure travels in the copy
                copied.set_exception(exc)

        self._rows.add_done_callback(copy)
        return copied


class StructuredOutputManager:
    """Grammars of the core's constrained requests and the bitmask of each step."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int, max_num_reqs: int,
                 device: torch.device) -> None:
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.max_num_reqs = max_num_reqs
        self.device = device
        # Unfinished requests that hold a grammar (compiling or started), by id.
        self.requests: dict[str, Request] = {}
        # Steps that built a bitmask, and the rows they filled (cumulative).
        self.num_bitmasks = 0
        self.num_bitmask_rows = 0
        # Made when the first constraint arrives: nothing here loads llguidance before.
        self._compile_pool: ThreadPoolExecutor | None = None
        self._fill_pool: ThreadPoolExecutor | None = None
        self._compilers: dict[tuple[int, ...], GrammarCompiler] = {}
        self._compiler_lock = threading.Lock()
        self._executor: llguidance.LLExecutor | None = None
        self._bitmask: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Starts compiling the request's constraint; `request.grammar` follows it."""
        spec = request.sampling_params.structured_outputs
        assert spec is not None
        if self._compile_pool is None:
            self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="kvferry-grammar")
        future = self._compile_pool.submit(self._compile, spec, tuple(request.eos_token_ids))
        request.grammar = RequestGrammar(future)
        self.requests[request.request_id] = request

    def remove_request(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)

    def _compile(self, spec: StructuredOutputsParams, eos: tuple[int, ...]) -> llguidance.LLMatcher:
        return self._compiler(eos).compile(spec)

    def _compiler(self, eos: tuple[int, ...]) -> GrammarCompiler:
        """The compiler for these EOS ids (every request of a model has the same), made once."""
        with self._compiler_lock:
            compiler = self._compilers.get(eos)
            if compiler is None:
                tokenizer_json = read_tokenizer_json(self.tokenizer_dir)
                compiler = GrammarCompiler(tokenizer_json, self.vocab_size, list(eos))
                self._compilers[eos] = compiler
            return compiler

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Blocks until a pending compile ends or `timeout_s` passes (an engine with nothing
        else to compute waits here instead of spinning)."""
        pending = [r.grammar.compiled for r in self.requests.values()
                   if r.grammar is not None and not r.grammar.is_compiled]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------------ each step
    def sampling_requests(self, scheduled: dict[str, int]) -> list[str]:
        """Constrained requests that sample a token in a step scheduling `scheduled`
        (req_id -> tokens, counted before `num_computed_tokens` advances): those whose
        tokens reach the end of what they know (output placeholders of async scheduling
        included); a prefill chunk short of it samples nothing."""
        return [
            req_id for req_id, request in self.requests.items()
            if req_id in scheduled and request.grammar is not None
            and request.grammar.matcher is not None
            and request.num_computed_tokens + scheduled[req_id]
            >= request.num_tokens + request.num_output_placeholders
        ]

    def start_bitmask(self, req_ids: list[str]) -> GrammarBitmask:
        """Starts filling the step's bitmask for `req_ids` (non-empty) on a worker thread."""
        import llguidance

        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="kvferry-bitmask")
            self._executor = llguidance.LLExecutor()
            # A started matcher exists, so its compiler does: it says how wide rows are.
            with self._compiler_lock:
                vocab = max(c.mask_vocab_size for c in self._compilers.values())
            words = num_bitmask_words(vocab)
            # Pinned on a GPU machine: the runner's copy to the device does not wait for it.
            self._bitmask = torch.zeros((self.max_num_reqs, words), dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        matchers = [self.requests[r].grammar.matcher for r in req_ids]  # type: ignore[union-attr]
        self.num_bitmasks += 1
        self.num_bitmask_rows += len(matchers)
        return GrammarBitmask(list(req_ids), self._fill_pool.submit(self._fill, matchers))

    def _fill(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        assert self._bitmask is not None and self._executor is not None
        return fill_bitmask(self._executor, matchers, self._bitmask)

    def accept_token(self, request: Request, token_id: int) -> str | None:
        """Advances the request's matcher by its sampled token.

        Returns None to go on, "stop" when the grammar is complete (nothing may follow), or
        an error message when the token does not fit (the mask makes this impossible unless
        every token was ruled out, e.g. min_tokens holding back the only allowed EOS).
        """
        grammar = request.grammar
        assert grammar is not None and grammar.matcher is not None
        matcher = grammar.matcher
        if not matcher.consume_token(token_id):
            return f"the constraint allows no token here: {matcher.get_error().splitlines()[0]}"
        return "stop" if matcher.is_stopped() else None

    def shutdown(self) -> None:
        for pool in (self._compile_pool, self._fill_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
