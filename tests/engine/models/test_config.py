"""ModelArchConfig: both rope layouts, eos union, derived head size, validation."""

from __future__ import annotations

import json

import pytest

from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.models.registry import SUPPORTED_ARCHITECTURES, get_model_class


def _raw(**overrides):
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
    }
    raw.update(overrides)
    return raw


def test_from_pretrained_reads_checkpoint(make_checkpoint):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = ModelArchConfig.from_pretrained(make_checkpoint(rope_scaling=scaling))
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (2, 64, 128)
    assert (config.num_heads, config.num_kv_heads, config.head_size) == (4, 2, 16)
    assert (config.vocab_size, config.max_position_embeddings) == (256, 1024)
    assert config.rope_theta == 10000.0
    assert config.rope_scaling == scaling
    assert config.rms_norm_eps == 1e-6
    assert (config.bos_token_id, config.eos_token_ids) == (1, [2])
    assert config.tie_word_embeddings is False
    assert config.attention_bias is False
    assert config.torch_dtype == "float32"


def test_legacy_rope_layout():
    raw = _raw(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    config = ModelArchConfig.from_dict(raw)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_default_rope_is_none():
    config = ModelArchConfig.from_dict(
        _raw(rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    )
    assert (config.rope_theta, config.rope_scaling) == (1e6, None)


def test_eos_ids_union_of_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_raw(eos_token_id=[2, 5])))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    config = ModelArchConfig.from_pretrained(tmp_path)
    assert config.eos_token_ids == [2, 5, 7]
    assert config.raw["generation_config"] == {"eos_token_id": [5, 7]}


def test_head_dim_and_kv_heads_defaults():
    config = ModelArchConfig.from_dict(_raw(head_dim=None, num_key_value_heads=None))
    assert (config.head_size, config.num_kv_heads) == (16, 4)
    assert ModelArchConfig.from_dict(_raw(head_dim=32)).head_size == 32


def test_dtype_field_of_either_spelling():
    assert ModelArchConfig.from_dict(_raw(torch_dtype="bfloat16")).torch_dtype == "bfloat16"
    assert ModelArchConfig.from_dict(_raw(dtype="float16")).torch_dtype == "float16"


def test_invalid_configs_raise():
    with pytest.raises(ValueError, match="no 'architectures'"):
        ModelArchConfig.from_dict(_raw(architectures=[]))
    with pytest.raises(
        ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"
    ):
        ModelArchConfig.from_dict(_raw(num_key_value_heads=3))
    with pytest.raises(ValueError, match="lacks the required field 'vocab_size'"):
        ModelArchConfig.from_dict(_raw(vocab_size=None))


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        ModelArchConfig.from_pretrained(tmp_path)


def test_registry():
    assert SUPPORTED_ARCHITECTURES == (
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "BartForConditionalGeneration",
        "WhisperForConditionalGeneration",
    )
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    assert get_model_class("BartForConditionalGeneration").__module__ == "kvferry.engine.models.bart"
    assert get_model_class("WhisperForConditionalGeneration").__module__ == (
        "kvferry.engine.models.whisper"
    )
    with pytest.raises(ValueError) as err:
        get_model_class("GPT2LMHeadModel")
    assert str(err.value) == (
        "unsupported architecture 'GPT2LMHeadModel'; "
        "supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
        "BartForConditionalGeneration, WhisperForConditionalGeneration"
    )
