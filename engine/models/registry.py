"""Maps a checkpoint's `architectures` name to the model class that runs it."""

from __future__ import annotations

import importlib

# Architecture name -> (module under kvferry.engine.models, class name). Modules import
# on first use, so listing an architecture costs nothing.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    # Encoder-decoder models (see encoder_decoder.py).
    "BartForConditionalGeneration": ("bart", "BartForConditionalGeneration"),
    "WhisperForConditionalGeneration": ("whisper", "WhisperForConditionalGeneration"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def get_model_class(architecture: str) -> type:
    """Returns the class implementing `architecture`; ValueError when there is none."""
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"kvferry.engine.models.{module_name}")
    return getattr(module, class_name)
