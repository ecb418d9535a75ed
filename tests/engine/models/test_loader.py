"""load_model: names, fusing, dtypes, and errors for incomplete checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kvferry.engine.attention.torch_backend import TorchAttentionBackend
from kvferry.engine.layers.linear import Linear
from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.models.loader import load_model, resolve_dtype

CPU = torch.device("cpu")
PROMPTS = [[5, 9, 200, 31, 7], [44], [3, 3, 90]]
# A second step's tokens for each of PROMPTS.
MORE_TOKENS = [[11, 12], [13], [14, 15, 16]]


def _load(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return load_model(path, dtype, TorchAttentionBackend(), CPU)


def _rewrite_weights(src: Path, dst: Path, edit) -> Path:
    """Copies checkpoint `src` to `dst` with its single weights file passed through `edit`."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    save_file(edit(weights), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_fused_projections_hold_checkpoint_tensors(make_checkpoint):
    path = make_checkpoint("Qwen2ForCausalLM")
    model = _load(path)
    weights = load_file(str(path / "model.safetensors"))
    attn = model.model.layers[1].self_attn
    expected_w = torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    expected_b = torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, expected_w)
    assert torch.equal(attn.qkv_proj.bias, expected_b)
    assert attn.o_proj.bias is None
    mlp = model.model.layers[0].mlp
    expected = torch.cat([weights[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(mlp.gate_up_proj.weight, expected)


def test_tied_model_has_no_lm_head(make_checkpoint):
    path = make_checkpoint(tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    model = _load(path)
    assert model.lm_head is None
    hidden = torch.randn(3, 64)
    expected = hidden @ model.model.embed_tokens.weight.T  # (3, vocab_size)
    torch.testing.assert_close(model.compute_logits(hidden), expected)


def test_sharded_equals_single_file(make_checkpoint):
    single = _load(make_checkpoint(seed=3))
    sharded_path = make_checkpoint(seed=3, sharded=True)
    assert (
        len(
            set(
                json.loads((sharded_path / "model.safetensors.index.json").read_text())[
                    "weight_map"
                ].values()
            )
        )
        > 1
    )
    sharded = _load(sharded_path)
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name


def test_missing_tensors_are_listed(make_checkpoint, tmp_path):
    def drop_layer_1(weights):
        return {k: v for k, v in weights.items() if not k.startswith("model.layers.1.")}

    path = _rewrite_weights(make_checkpoint(), tmp_path / "ckpt", drop_layer_1)
    with pytest.raises(ValueError) as err:
        _load(path)
    message = str(err.value)
    assert "is missing 9 tensors the model needs: " in message
    assert "model.layers.1.input_layernorm.weight, model.layers.1.mlp.down_proj.weight" in message
    assert message.endswith("and 1 more")


def test_missing_lm_head_of_untied_model(make_checkpoint, tmp_path):
    path = _rewrite_weights(
        make_checkpoint(),
        tmp_path / "ckpt",
        lambda w: {k: v for k, v in w.items() if k != "lm_head.weight"},
    )
    with pytest.raises(ValueError, match=r"is missing 1 tensors the model needs: lm_head.weight$"):
        _load(path)


def test_unexpected_tensors_are_ignored(make_checkpoint, tmp_path):
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    original = make_checkpoint()
    path = _rewrite_weights(original, tmp_path / "ckpt", lambda w: {**w, **extra})
    for (name, a), (_, b) in zip(
        _load(original).named_parameters(), _load(path).named_parameters()
    ):
        assert torch.equal(a, b), name


def test_wrong_shape_is_named(make_checkpoint, tmp_path):
    def shrink(weights):
        weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
        return weights

    path = _rewrite_weights(make_checkpoint(), tmp_path / "ckpt", shrink)
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.self_attn.k_proj.weight has shape "
        r"\(16, 64\), the model expects \(32, 64\)",
    ):
        _load(path)


def test_no_safetensors(tmp_path, make_checkpoint):
    shutil.copy(make_checkpoint() / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        _load(tmp_path)


@pytest.mark.parametrize(
    "architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
)
def test_bfloat16_loading_matches_hf_in_bfloat16(
    make_checkpoint, hf_model, paged_run, architecture: str
) -> None:
    path = make_checkpoint(architecture)
    model = _load(path, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_cache.dtype == torch.bfloat16
    run = paged_run(model, num_reqs=3, max_len=8, dtype=torch.bfloat16)
    # A prefill of each prompt (one is a single token), then a chunk after cached tokens
    # or a decode over the bfloat16 cache.
    first, second = run.step(PROMPTS), run.step(MORE_TOKENS)
    hf = hf_model(path, torch.bfloat16, "sdpa")
    for prompt, more, logits_a, logits_b in zip(PROMPTS, MORE_TOKENS, first, second):
        assert logits_a.dtype == logits_b.dtype == torch.float32
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt + more])).logits[0].float()
        # Exact: HF's sdpa attention makes the engine's scaled_dot_product_attention call on
        # the same bfloat16 values, and every other op rounds to bfloat16 where HF's does
        # (float32 weights give logits about 0.1 away from these).
        torch.testing.assert_close(torch.cat([logits_a, logits_b]), expected, atol=0, rtol=0)


def test_bfloat16_checkpoint_upcast_matches_hf(make_checkpoint, hf_logits, paged_run):
    path = make_checkpoint(dtype="bfloat16")
    model = _load(path)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    for prompt, logits in zip(PROMPTS, paged_run(model, num_reqs=3, max_len=8).step(PROMPTS)):
        torch.testing.assert_close(logits, hf_logits(path, prompt), atol=1e-4, rtol=0)


def test_resolve_dtype(make_checkpoint):
    arch = ModelArchConfig.from_pretrained(make_checkpoint(dtype="bfloat16"))
    assert arch.torch_dtype == "bfloat16"
    assert resolve_dtype("auto", arch) == torch.float32
    assert resolve_dtype(None, arch) == torch.float32
    assert resolve_dtype("auto", arch, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", arch) == torch.bfloat16
    assert resolve_dtype("float16", arch) == torch.float16
    assert resolve_dtype("float32", arch) == torch.float32
    with pytest.raises(ValueError, match="unsupported dtype 'int8'; supported: auto, float32"):
        resolve_dtype("int8", arch)
    # A float32 checkpoint serves in bfloat16 on a GPU (and in float16 if stored so).
    float32_arch = ModelArchConfig.from_pretrained(make_checkpoint())
    assert resolve_dtype("auto", float32_arch, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", float32_arch) == torch.float32
    float16_arch = ModelArchConfig.from_pretrained(make_checkpoint(dtype="float16"))
    assert resolve_dtype("auto", float16_arch, torch.device("cuda")) == torch.float16


def _linears(model: torch.nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def test_float32_cpu_weights_are_prepacked(make_checkpoint):
    model = _load(make_checkpoint())
    linears = _linears(model)
    # qkv, o, gate_up and down per layer, plus the untied lm_head.
    assert len(linears) == 4 * model.config.num_layers + 1
    assert all(m._packed_weight is not None for m in linears)
    for m in linears:
        x = torch.randn(5, m.input_size)
        # The packed GEMM is the same product as the plain one (up to summation order).
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), atol=1e-5, rtol=1e-5)


def test_packed_linear_serves_any_number_of_rows(make_checkpoint):
    qkv = _load(make_checkpoint("Qwen2ForCausalLM")).model.layers[0].self_attn.qkv_proj
    assert qkv._packed_weight is not None and qkv.bias is not None
    for rows in (0, 1, 3, 64, 65, 300):
        x = torch.randn(rows, qkv.input_size)
        expected = F.linear(x, qkv.weight, qkv.bias)
        torch.testing.assert_close(qkv(x), expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_weights_are_not_prepacked(make_checkpoint):
    model = _load(make_checkpoint(), torch.bfloat16)
    assert all(m._packed_weight is None for m in _linears(model))
