"""The step's index arrays reach the device in one copy, each slice equal to its array."""

from __future__ import annotations

import numpy as np
import torch
from kvferry.engine.runner.prepare_inputs import InputBuffers, prepare_inputs
from kvferry.engine.runner.step_staging import StepStaging


def prepared_example():
    # The worked example of prepare_inputs.py: scheduled 3, 2, 5 tokens, nothing computed,
    # block size 2, tables [1, 2], [3], [4, 5, 6]; every request completes its prompt.
    token_ids = np.arange(3 * 12, dtype=np.int32).reshape(3, 12) + 100
    block_table = np.zeros((3, 6), dtype=np.int32)
    block_table[0, :2], block_table[1, :1], block_table[2, :3] = [1, 2], [3], [4, 5, 6]
    return prepare_inputs(np.array([3, 2, 5]), np.zeros(3, dtype=np.int64), np.array([3, 2, 5]),
                          token_ids, block_table, 2, InputBuffers.allocate(16, 4))


def test_one_copy_carries_every_array_of_the_step() -> None:
    prepared = prepared_example()
    staging = StepStaging(16, 4, torch.device("cpu"), stage_on_cpu=True)
    staged = staging.stage(prepared)
    assert staged.input_ids.tolist() == [100, 101, 102, 112, 113, 124, 125, 126, 127, 128]
    assert staged.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    assert staged.slot_mapping.tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert staged.query_start_loc.tolist() == [0, 3, 5, 10]
    assert staged.seq_lens.tolist() == [3, 2, 5]
    assert staged.logits_indices.tolist() == [2, 4, 9]
    # All six are slices of the one device buffer, back to back.
    base = staging.on_device.data_ptr()
    offsets = [(t.data_ptr() - base) // 8 for t in (
        staged.input_ids, staged.positions, staged.slot_mapping, staged.query_start_loc,
        staged.seq_lens, staged.logits_indices)]
    assert offsets == [0, 10, 20, 30, 34, 37]


def test_on_the_cpu_the_host_arrays_are_read_in_place() -> None:
    prepared = prepared_example()
    staged = StepStaging(16, 4, torch.device("cpu")).stage(prepared)
    assert staged.positions.data_ptr() == prepared.positions.ctypes.data
    assert staged.slot_mapping.tolist() == prepared.slot_mapping.tolist()


def test_the_engine_gives_the_same_tokens_through_the_staging_buffer(make_checkpoint) -> None:
    from kvferry import LLM, SamplingParams

    llm = LLM(model=str(make_checkpoint()), max_model_len=64, block_size=4,
              max_num_batched_tokens=24, num_gpu_blocks_override=60, seed=0)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 30, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    direct = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.llm_engine.engine_core.runner
    runner.staging = StepStaging(24, runner.input_batch.max_num_reqs, runner.device,
                                 stage_on_cpu=True)
    staged = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert staged == direct


def test_sampled_tokens_and_logprobs_come_back_in_one_copy_exactly() -> None:
    from kvferry.engine.runner.model_runner import _copy_to_host
    from kvferry.engine.sample.sampler import LogprobsTensors, SamplerOutput

    torch.manual_seed(0)
    values = torch.randn(3, 4).log_softmax(dim=-1)  # float32
    ids = torch.tensor([[7, 1, 9, 2**40], [5, 5, 0, 3], [128255, 2, 4, 6]])
    ranks = torch.tensor([1, 17, 2**33])
    output = SamplerOutput(torch.tensor([7, 5, 128255]), LogprobsTensors(ids, values, ranks))
    sampled, (host_ids, host_values, host_ranks) = _copy_to_host(output)
    assert sampled.dtype == torch.int64 and sampled.tolist() == [7, 5, 128255]
    assert host_ids == ids.tolist() and host_ranks == ranks.tolist()
    assert host_values == values.tolist()  # float32 values survive float64 exactly
    assert _copy_to_host(SamplerOutput(torch.tensor([3]), None))[1] is None
