"""ModelArchConfig: both rope layouts, eos union, derived head size, validation."""

from __future__ import annotations

import json

import pytest
import torch

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
    assert get_model_class("BartForConditionalGeneration").__module__.endswith("models.bart")
    assert get_model_class("WhisperForConditionalGeneration").__module__.endswith("models.whisper")
    with pytest.raises(ValueError) as err:
        get_model_class("GPT2LMHeadModel")
    assert str(err.value) == (
        "unsupported architecture 'GPT2LMHeadModel'; "
        "supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
        "BartForConditionalGeneration, WhisperForConditionalGeneration"
    )


def _bart_raw(**overrides):
    raw = {
        "architectures": ["BartForConditionalGeneration"],
        "is_encoder_decoder": True,
        "d_model": 64,
        "encoder_layers": 3,
        "decoder_layers": 2,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 80,
        "decoder_ffn_dim": 96,
        "max_position_embeddings": 128,
        "vocab_size": 512,
    }
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not None}


def test_bart_config_describes_the_decoder_and_the_encoder(make_encdec_checkpoint):
    path = make_encdec_checkpoint(
        "bart", encoder_layers=3, encoder_attention_heads=2, encoder_ffn_dim=80
    )
    config = ModelArchConfig.from_pretrained(path)
    assert config.architecture == "BartForConditionalGeneration"
    assert config.is_encoder_decoder and config.encoder_input == "tokens"
    # The generic fields are the decoder's: its layers own the KV cache.
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (2, 64, 96)
    assert (config.num_heads, config.num_kv_heads, config.head_size) == (4, 4, 16)
    assert (config.vocab_size, config.max_position_embeddings) == (512, 128)
    assert (config.num_encoder_layers, config.max_encoder_positions, config.num_mel_bins) == (
        3, 128, 0
    )
    assert (config.bos_token_id, config.eos_token_ids, config.decoder_start_token_id) == (0, [2], 2)
    assert (config.hidden_act, config.tie_word_embeddings, config.attention_bias) == (
        "gelu", True, True
    )
    assert (config.raw["encoder_attention_heads"], config.raw["encoder_ffn_dim"]) == (2, 80)


def test_whisper_config_reads_each_side_positions(make_encdec_checkpoint):
    path = make_encdec_checkpoint("whisper", tie_word_embeddings=False)
    config = ModelArchConfig.from_pretrained(path)
    assert config.is_encoder_decoder and config.encoder_input == "audio"
    assert (config.num_layers, config.num_encoder_layers, config.num_mel_bins) == (2, 2, 16)
    assert (config.max_position_embeddings, config.max_encoder_positions) == (64, 100)
    generation = json.loads((path / "generation_config.json").read_text())
    assert config.decoder_start_token_id == generation["decoder_start_token_id"] == 502
    assert config.eos_token_ids == [501] and config.bos_token_id == 501
    assert config.tie_word_embeddings is False


def test_generation_config_start_token_wins():
    config = ModelArchConfig.from_dict(_bart_raw(decoder_start_token_id=2),
                                       {"decoder_start_token_id": 7})
    assert config.decoder_start_token_id == 7
    assert ModelArchConfig.from_dict(_bart_raw()).decoder_start_token_id is None
    # BART's own default when the file leaves it out.
    assert ModelArchConfig.from_dict(_bart_raw()).tie_word_embeddings is True


def test_invalid_encoder_decoder_configs_raise():
    with pytest.raises(ValueError, match=r"d_model \(64\) must be a multiple of "
                                         r"encoder_attention_heads \(3\)"):
        ModelArchConfig.from_dict(_bart_raw(encoder_attention_heads=3))
    with pytest.raises(ValueError, match=r"d_model \(64\) must be a multiple of "
                                         r"decoder_attention_heads \(0\)"):
        ModelArchConfig.from_dict(_bart_raw(decoder_attention_heads=0))
    with pytest.raises(ValueError, match="encoder_ffn_dim must be positive, got 0"):
        ModelArchConfig.from_dict(_bart_raw(encoder_ffn_dim=0))
    with pytest.raises(ValueError, match="num_encoder_layers must be positive, got 0"):
        ModelArchConfig.from_dict(_bart_raw(encoder_layers=0))
    with pytest.raises(ValueError, match="lacks the required field 'max_position_embeddings'"):
        ModelArchConfig.from_dict(_bart_raw(max_position_embeddings=None))
    with pytest.raises(ValueError, match="num_mel_bins must be positive, got 0"):
        ModelArchConfig.from_dict(_bart_raw(num_mel_bins=0))
    # Another encoder-decoder layout (T5's) is named by the field it lacks.
    t5 = {"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True,
          "d_model": 64, "num_layers": 2, "num_heads": 4, "d_ff": 128, "vocab_size": 100}
    with pytest.raises(ValueError, match="lacks the required field 'decoder_attention_heads'"):
        ModelArchConfig.from_dict(t5)


@pytest.mark.parametrize("kind", ["bart", "whisper"])
def test_unsupported_activation_is_named(kind, make_encdec_checkpoint, tmp_path):
    import shutil

    from kvferry.engine.attention.torch_backend import TorchAttentionBackend
    from kvferry.engine.models.loader import load_model

    path = tmp_path / kind
    shutil.copytree(make_encdec_checkpoint(kind), path)
    raw = json.loads((path / "config.json").read_text())
    raw["activation_function"] = "relu"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError) as err:
        load_model(path, torch.float32, TorchAttentionBackend(), torch.device("cpu"))
    assert str(err.value) == (
        f"{raw['architectures'][0]}: activation_function 'relu' is not supported; "
        "supported: gelu, gelu_new, gelu_pytorch_tanh"
    )


def test_a_model_refuses_the_other_encoder_input(make_encdec_checkpoint):
    from kvferry.engine.attention.torch_backend import TorchAttentionBackend
    from kvferry.engine.models.whisper import WhisperForConditionalGeneration

    config = ModelArchConfig.from_pretrained(make_encdec_checkpoint("bart"))
    with pytest.raises(ValueError) as err:
        WhisperForConditionalGeneration(config, TorchAttentionBackend(), torch.float32)
    assert str(err.value) == (
        "BartForConditionalGeneration needs an encoder-decoder config whose encoder reads "
        "audio, got is_encoder_decoder=True, encoder_input='tokens'"
    )
