"""Builds a model from an HF checkpoint directory of safetensors files.

Checkpoint names map onto the model's parameters one to one, except for the fused
projections: `...self_attn.q_proj.weight` fills the first row block of
`...self_attn.qkv_proj.weight`, `k_proj` the second, and so on (the model's
`packed_modules_mapping` says which). Extra checkpoint tensors (rotary `inv_freq`, a
tied `lm_head`) are ignored; a missing one is an error, except a name ending in one of the
model's `zero_when_absent` suffixes: that block is zero (Whisper's key projections have no
bias, but share a fused projection with the query and value ones, which do).

A model built for one pipeline stage holds only its share of the layers, numbered from 0;
its `checkpoint_name` maps a parameter name to the checkpoint's (local layer i of a stage
starting at layer s is the checkpoint's layer s + i), and only those tensors are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from kvferry.engine.attention.backend import AttentionBackend
from kvferry.engine.executor.partition import PipelineStage
from kvferry.engine.layers.kernels import use_triton_kernels
from kvferry.engine.layers.linear import Linear, prepack_linear_weights
from kvferry.engine.layers.tensor_parallel import TensorParallel, shard_heads
from kvferry.engine.models.checkpoint import checkpoint_files
from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.models.registry import get_model_class
from torch import nn

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

# How many missing names an error spells out before it only counts the rest.
_MAX_NAMES_SHOWN = 8


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: a parameter, or one row block of a fused one."""

    param_name: str
    # Row block of a fused `Linear`; None when the tensor fills the whole parameter.
    shard_index: int | None


def resolve_dtype(
    name: str | None, arch: ModelArchConfig, device: torch.device | None = None
) -> torch.dtype:
    """Turns a `--dtype` value into a torch dtype.

    "auto" (or None) means float32 on a CPU, where half-precision matmuls are slow, and
    the checkpoint's own half-precision dtype on an accelerator, bfloat16 for a float32 (or
    unstated) one: float32 would halve the throughput and the KV cache for no gain in
    serving quality.
    """
    if name is None or name == "auto":
        if device is None or device.type == "cpu":
            return torch.float32
        stored = _DTYPES.get(arch.torch_dtype or "float32", torch.float32)
        return torch.bfloat16 if stored == torch.float32 else stored
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; supported: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _checkpoint_targets(model: nn.Module) -> dict[str, _Target]:
    """Maps every checkpoint tensor name the model needs to where it is copied."""
    packed: dict[str, tuple[str, ...]] = getattr(model, "packed_modules_mapping", {})
    rename = getattr(model, "checkpoint_name", _same_name)
    targets: dict[str, _Target] = {}
    for param_name, _ in model.named_parameters():
        # A parameter of the model itself (BART's final_logits_bias) has no module path.
        module_path, _, leaf = param_name.rpartition(".")
        parent, _, module_name = module_path.rpartition(".")
        prefix = f"{parent}." if parent else ""
        if module_name in packed:
            for index, part in enumerate(packed[module_name]):
                targets[rename(f"{prefix}{part}.{leaf}")] = _Target(param_name, index)
        else:
            targets[rename(param_name)] = _Target(param_name, None)
    return targets


def _same_name(name: str) -> str:
    return name


def _missing_error(model_dir: Path, missing: list[str]) -> ValueError:
    shown = ", ".join(missing[:_MAX_NAMES_SHOWN])
    more = f" and {len(missing) - _MAX_NAMES_SHOWN} more" if len(missing) > _MAX_NAMES_SHOWN else ""
    return ValueError(
        f"checkpoint {model_dir} is missing {len(missing)} tensors the model needs: {shown}{more}"
    )


def _destination(model: nn.Module, target: _Target) -> torch.Tensor:
    """The parameter data, or the row block of it, that `target` names."""
    dest = model.get_parameter(target.param_name).data
    if target.shard_index is not None:
        module = model.get_submodule(target.param_name.rsplit(".", 1)[0])
        if not isinstance(module, Linear):
            raise TypeError(f"{target.param_name} is listed as packed but is not a Linear")
        start, end = module.shard_rows(target.shard_index)
        dest = dest[start:end]
    return dest


def _copy_tensor(model: nn.Module, name: str, target: _Target, tensor: torch.Tensor) -> None:
    owner = target.param_name.rpartition(".")[0]
    load = getattr(model.get_submodule(owner) if owner else model, "load_checkpoint_tensor",
                   None)
    if load is not None:  # a tensor-parallel layer copies its own shard of the tensor
        try:
            load(model.get_parameter(target.param_name).data, target.shard_index, tensor)
        except RuntimeError as e:
            raise ValueError(f"checkpoint tensor {name} of shape {tuple(tensor.shape)} does "
                             f"not fit this rank's shard: {e}") from e
        return
    dest = _destination(model, target)
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(dest.shape)}"
        )
    dest.copy_(tensor)


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Fills every parameter of `model` from the safetensors files in `model_dir`."""
    from safetensors import safe_open

    files = checkpoint_files(model_dir)
    targets = _checkpoint_targets(model)
    names_by_file: dict[Path, list[str]] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names_by_file[path] = [n for n in f.keys() if n in targets]
    found = {n for names in names_by_file.values() for n in names}
    missing = sorted(set(targets) - found)
    zero_suffixes: tuple[str, ...] = tuple(getattr(model, "zero_when_absent", ()))
    zeroed = [n for n in missing if zero_suffixes and n.endswith(zero_suffixes)]
    missing = [n for n in missing if n not in zeroed]
    if missing:
        raise _missing_error(model_dir, missing)
    for name in zeroed:
        _destination(model, targets[name]).zero_()
    for path, names in names_by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                _copy_tensor(model, name, targets[name], f.get_tensor(name))


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    attn_backend: AttentionBackend,
    device: torch.device,
    stage: PipelineStage | None = None,
    tp: TensorParallel | None = None,
) -> nn.Module:
    """Builds the checkpoint's model class on `device` in `dtype` and loads its weights;
    with `stage`, only that pipeline stage's part of the model (and of the weights); with
    `tp` of size > 1, this tensor-parallel rank's shard of every layer."""
    model_dir = Path(model_dir)
    config = ModelArchConfig.from_pretrained(model_dir)
    model_class = get_model_class(config.architecture)
    if stage is not None and stage.num_stages > 1:
        check_pipeline_support(config, stage.num_stages)
    kwargs: dict[str, object] = {} if stage is None else {"stage": stage}
    if tp is not None and tp.size > 1:
        check_tensor_parallel_support(config, tp.size)
        kwargs["tp"] = tp
    with torch.device(device):
        model = model_class(config, attn_backend, dtype, **kwargs)
    load_weights(model, model_dir)
    prepack_linear_weights(model)
    if attn_backend.name == "triton":
        use_triton_kernels(model)
    return model.eval()


def check_tensor_parallel_support(config: ModelArchConfig, tp_size: int) -> None:
    """ValueError unless the checkpoint's model can be split over `tp_size` ranks."""
    if tp_size == 1:
        return
    if not getattr(get_model_class(config.architecture), "supports_tensor_parallel", False):
        raise ValueError(f"{config.architecture} has no tensor parallelism: "
                         f"tensor_parallel_size must be 1, got {tp_size}")
    shard_heads(config.num_heads, config.num_kv_heads, TensorParallel(0, tp_size))


def check_pipeline_support(config: ModelArchConfig, pp_size: int) -> None:
    """ValueError unless the checkpoint's model can be split into `pp_size` stages."""
    if pp_size == 1:
        return
    model_class = get_model_class(config.architecture)
    if not getattr(model_class, "supports_pipeline_parallel", False):
        kind = "an encoder-decoder model" if config.is_encoder_decoder else "this model"
        raise ValueError(f"{config.architecture} is {kind} without pipeline parallelism: "
                         f"pipeline_parallel_size must be 1, got {pp_size}")
