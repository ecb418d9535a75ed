"""`kvferry generate`: run prompts through an engine offline and print the completions."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from kvferry.engine.arg_utils import add_engine_arguments, engine_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text (repeat for several prompts)")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=32,
                          help="tokens to generate per completion")
    sampling.add_argument("--temperature", type=float, default=0.0,
                          help="sampling temperature; 0 is greedy")
    sampling.add_argument("--top-p", type=float, default=1.0,
                          help="sample from the smallest set of tokens this likely")
    sampling.add_argument("--top-k", type=int, default=0,
                          help="sample from the k likeliest tokens; 0 is all")
    sampling.add_argument("--min-p", type=float, default=0.0,
                          help="drop tokens less likely than this times the likeliest")
    sampling.add_argument("--n", type=int, default=1, help="completions per prompt")
    sampling.add_argument("--sampling-seed", type=int, default=None,
                          help="seed of the sampler, for repeatable samples (default: none)")
    sampling.add_argument("--stop", action="append", default=None,
                          help="stop string (repeatable; default: none)")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="keep generating past the end-of-sequence token")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from kvferry.engine.frontend.llm_engine import LLMEngine
    from kvferry.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
            stop=args.stop, ignore_eos=args.ignore_eos,
        )
        engine = LLMEngine(engine_config_from_args(args))
        for i, prompt in enumerate(args.prompt):
            engine.add_request(str(i), prompt, params)
    except ValueError as exc:
        print(f"kvferry generate: error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    elapsed = time.perf_counter() - start
    for i, prompt in enumerate(args.prompt):
        _print_output(prompt, finished[str(i)], args.json)
    num_tokens = sum(len(c.token_ids) for o in finished.values() for c in o.outputs)
    print(f"# {num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tokens/s)",
          file=sys.stderr)
    return 0


def _print_output(prompt: str, output, as_json: bool) -> None:  # noqa: ANN001
    if as_json:
        print(json.dumps({
            "prompt": prompt,
            "completions": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                for c in output.outputs
            ],
        }))
        return
    for completion in output.outputs:
        print(f"{prompt!r} -> {completion.text!r} [{completion.finish_reason}]")
