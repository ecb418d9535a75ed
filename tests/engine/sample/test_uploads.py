"""The sampling metadata's upload: arrays packed per dtype, one copy each, through two
pinned buffers used in turn (checked on the CPU with the packing forced)."""

from __future__ import annotations

import numpy as np
import torch
from kvferry.engine.sample.metadata import SamplingMetadata
from kvferry.engine.sample.uploads import PinnedUploads, upload
from kvferry.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _arrays(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100, size=5).astype(np.int64),
            rng.random(3).astype(np.float32),
            rng.integers(0, 9, size=(2, 4)).astype(np.int64),
            rng.random(4) > 0.5,
            rng.random((2, 2)).astype(np.float32)]


def test_arrays_of_one_dtype_share_one_buffer_in_order() -> None:
    arrays = _arrays(0)
    tensors = upload(arrays, CPU, pack_on_cpu=True)
    for array, tensor in zip(arrays, tensors, strict=True):
        assert tensor.shape == array.shape
        assert np.array_equal(tensor.numpy(), array)
    ints = [tensors[0], tensors[2]]
    assert ints[0].untyped_storage().data_ptr() == ints[1].untyped_storage().data_ptr()
    # Back to back: the second int64 array starts where the first ends.
    assert ints[1].data_ptr() - ints[0].data_ptr() == 5 * 8
    assert tensors[1].untyped_storage().data_ptr() == tensors[4].untyped_storage().data_ptr()
    assert tensors[3].dtype == torch.bool


def storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_pinned_buffers_take_turns_and_grow() -> None:
    pinned = PinnedUploads()
    first = upload(_arrays(1), CPU, pinned, pack_on_cpu=True)
    second = upload(_arrays(2), CPU, pinned, pack_on_cpu=True)
    assert storage(first[0]) != storage(second[0])
    values = first[0].clone()
    third = upload(_arrays(3), CPU, pinned, pack_on_cpu=True)
    assert storage(third[0]) == storage(first[0])  # the first step's buffer again
    assert not torch.equal(first[0], values)  # refilled (the first step is long done)
    big = upload([np.arange(5000, dtype=np.int64)], CPU, pinned, pack_on_cpu=True)
    assert big[0].tolist() == list(range(5000))


def test_metadata_tensors_match_the_params() -> None:
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3,
                             repetition_penalty=1.3, logit_bias={4: 2.0}),
              SamplingParams(temperature=1.2, allowed_token_ids=[1, 2])]
    metadata = SamplingMetadata.build(params, [[1], [2, 3], []], [[5], [6, 7, 8], [9]],
                                      {0: [2]}, 10, CPU)
    assert metadata.is_greedy.tolist() == [True, False, False]
    assert metadata.temperature.tolist() == [1.0, np.float32(0.7), np.float32(1.2)]
    assert metadata.top_k.tolist() == [10, 5, 10] and metadata.max_top_k == 5
    assert metadata.seeded_rows.tolist() == [1] and metadata.seed_steps.tolist() == [2]
    assert metadata.output_token_ids.tolist() == [[1, 10], [2, 3], [10, 10]]
    assert metadata.prompt_token_ids.tolist() == [[5, 10, 10], [6, 7, 8], [9, 10, 10]]
    assert metadata.blocked_rows.tolist() == [0] and metadata.blocked_token_ids.tolist() == [2]
    assert metadata.bias_rows.tolist() == [1] and metadata.bias_values.tolist() == [2.0]
    assert metadata.allowed_rows.tolist() == [2]
    assert metadata.allowed_mask[0].nonzero().flatten().tolist() == [1, 2]
