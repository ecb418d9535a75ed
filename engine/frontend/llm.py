"""The offline API, with vLLM's names: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence

from kvferry.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvferry.engine.frontend.llm_engine import (
    LLMEngine,
    ProcessedPrompt,
    PromptType,
    RequestOutputKind,
)
from kvferry.engine.frontend.outputs import RequestOutput
from kvferry.engine.sampling_params import SamplingParams


class LLM:
    """An engine for offline batch generation.

    Example::

        llm = LLM(model="demo", max_model_len=512)
        for out in llm.generate(["Hello", "The sky"], SamplingParams(max_tokens=8)):
            print(out.prompt, "->", out.outputs[0].text)

    With `pipeline_parallel_size` P > 1 the model's layers are split over P worker
    processes, and with `tensor_parallel_size` T > 1 each stage's layers over T of them
    (P x T workers; multiprocessing spawn: a script that makes such an `LLM` at import time
    needs the `if __name__ == "__main__":` guard); `shutdown()` stops them, as does the
    interpreter's exit.
    """

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        scheduling_policy: str = "fcfs",
        seed: int = 0,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        attention_backend: str = "auto",
        device: str = "auto",
        served_model_name: str | None = None,
        enable_prompt_embeds: bool = False,
        max_num_encoder_tokens: int | None = None,
        async_scheduling: bool = False,
        enforce_eager: bool = False,
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        pp_layer_partition: list[int] | None = None,
    ) -> None:
        config = EngineConfig(
            model=ModelConfig(
                model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
                seed=seed, served_model_name=served_model_name,
                enable_prompt_embeds=enable_prompt_embeds,
            ),
            cache=CacheConfig(
                block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
                num_gpu_blocks_override=num_gpu_blocks_override,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill, policy=scheduling_policy,  # type: ignore[arg-type]
                max_num_encoder_tokens=max_num_encoder_tokens,
                async_scheduling=async_scheduling,
            ),
            attention_backend=attention_backend,
            device=device,
            enforce_eager=enforce_eager,
            parallel=ParallelConfig(
                pipeline_parallel_size=pipeline_parallel_size,
                tensor_parallel_size=tensor_parallel_size,
                pp_layer_partition=pp_layer_partition,
            ),
        )
        self.llm_engine = LLMEngine(config)

    def shutdown(self) -> None:
        """Stops the engine's threads and worker processes (pipeline stages); the `LLM`
        cannot generate afterwards."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):  # noqa: ANN201 - the engine's Tokenizer
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates completions for every prompt; returns them in input order.

        A prompt is a string, a list of token ids, `{"prompt": text}`,
        `{"prompt_token_ids": ids}`, or (with `enable_prompt_embeds=True`)
        `{"prompt_embeds": tensor}` of shape `(num_tokens, hidden_size)` (a leading batch
        dimension of 1 is squeezed). All prompts and structured-output constraints are
        validated before any runs, so a bad one raises ValueError and nothing is queued.
        """
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
        engine = self.llm_engine
        processed = [_processed(engine, p) for p in prompt_list]
        for p in params:
            engine.input_processor.check_structured_outputs(p)
        request_ids = []
        for i, (prompt, p) in enumerate(zip(processed, params)):
            request_id = engine.next_request_id()
            engine.add_request(
                request_id, prompt, p, priority=priority[i] if priority else 0,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            request_ids.append(request_id)
        return self._run_engine(request_ids, use_tqdm)

    def encode(
        self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """Runs only the encoder of each prompt of an encoder-decoder model and leaves its
        cross-attention KV in the prefix cache, so a later request with the same encoder
        input starts decoding without running the encoder. Each output has no completion
        tokens (finish_reason "stop"). Needs prefix caching (the KV would be freed unused
        otherwise)."""
        engine = self.llm_engine
        if not engine.config.cache.enable_prefix_caching:
            raise ValueError("encode leaves the encoder's KV in the prefix cache: enable "
                             "prefix caching")
        processed = [_processed(engine, p) for p in _as_prompt_list(prompts)]
        request_ids = []
        for prompt in processed:
            request_id = engine.next_request_id()
            engine.add_request(request_id, prompt, SamplingParams(max_tokens=1),
                               output_kind=RequestOutputKind.FINAL_ONLY, encode_only=True)
            request_ids.append(request_id)
        return self._run_engine(request_ids, use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        return [finished[r] for r in request_ids]


def _processed(engine: LLMEngine, prompt: PromptType | ProcessedPrompt) -> ProcessedPrompt:
    """A prompt tokenized and checked (one the caller processed already is kept)."""
    if isinstance(prompt, ProcessedPrompt):
        engine.input_processor.check_processed(prompt)
        return prompt
    return engine.process_prompt(prompt)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, ProcessedPrompt):
        return [prompts]
    prompts = list(prompts)  # type: ignore[arg-type]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} sampling params for {num_prompts} prompts")
    return params
