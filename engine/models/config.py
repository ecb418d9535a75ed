"""The architecture of a checkpoint, read from its `config.json` (and generation config)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


# What an encoder reads (`ModelArchConfig.encoder_input`).
ENCODER_INPUTS = ("tokens", "audio")


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _as_id_list(value: Any) -> list[int]:
    """An eos field is an int, a list of ints, or absent."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _require(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"config.json lacks the required field {key!r}")
    return raw[key]


def _rope_params(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Returns `(rope_theta, rope_scaling)` from either config layout.

    transformers 4 writes `rope_theta` at the top level and `rope_scaling` beside it;
    transformers 5 writes one `rope_parameters` dict holding `rope_theta` too. The
    scaling comes back with its type under `rope_type` (older files say `type`), and
    as None when it is plain rope.
    """
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    rope_type = scaling.pop("type", None)
    scaling.setdefault("rope_type", rope_type or "default")
    if scaling["rope_type"] == "default":
        return float(theta), None
    return float(theta), scaling


def _check_encoder_decoder_sizes(raw: dict[str, Any], hidden_size: int) -> None:
    """Each side's heads split d_model evenly; the encoder's feed-forward size (read by the
    model from `raw`) is positive."""
    for key in ("decoder_attention_heads", "encoder_attention_heads"):
        heads = int(_require(raw, key))
        if heads <= 0 or hidden_size % heads:
            raise ValueError(f"d_model ({hidden_size}) must be a multiple of {key} ({heads})")
    if int(_require(raw, "encoder_ffn_dim")) <= 0:
        raise ValueError(f"encoder_ffn_dim must be positive, got {raw['encoder_ffn_dim']}")


@dataclass(frozen=True)
class ModelArchConfig:
    """What the model definitions need to know about a checkpoint (decoder-only, or an
    encoder-decoder one: see the encoder fields)."""

    # The HF class name, e.g. "LlamaForCausalLM" (first of `architectures`).
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    # Query heads; `num_kv_heads` divides it (GQA), 1 is MQA.
    num_heads: int
    num_kv_heads: int
    # `head_dim` when the config gives one (Qwen3 does), else hidden_size // num_heads.
    head_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain rope; else the scaling dict with its `rope_type` ("llama3", ...).
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    # Bias on the attention projections (Llama, Qwen3: q/k/v and o; Qwen2 ignores it).
    attention_bias: bool
    bos_token_id: int | None
    # Union of config.json's and generation_config.json's eos ids, in first-seen order.
    eos_token_ids: list[int]
    # The checkpoint's stored dtype name ("bfloat16", ...), None when unstated.
    torch_dtype: str | None
    hidden_act: str = "silu"
    mlp_bias: bool = False
    # Encoder-decoder models (BART, Whisper). Everything above describes the decoder (its
    # layers own the KV cache: self-attention blocks and cross-attention blocks share one
    # layout); these fields describe the encoder side.
    is_encoder_decoder: bool = False
    # What the encoder reads: "tokens" (BART) or "audio" (Whisper's log-mel features).
    encoder_input: str = "tokens"
    num_encoder_layers: int = 0
    # The longest encoder input in positions (Whisper: exactly this many, always).
    max_encoder_positions: int = 0
    # The token a decoder prompt starts with (prepended when a prompt lacks it).
    decoder_start_token_id: int | None = None
    # Whisper: mel bins of the features (frames = 2 * max_encoder_positions).
    num_mel_bins: int = 0
    # config.json as read, with generation_config.json under "generation_config"; for
    # fields not modeled here.
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.is_encoder_decoder:
            self._check_encoder_fields()

    def _check_encoder_fields(self) -> None:
        for name in ("num_encoder_layers", "max_encoder_positions"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.encoder_input not in ENCODER_INPUTS:
            raise ValueError(
                f"encoder_input must be one of {', '.join(ENCODER_INPUTS)}, "
                f"got {self.encoder_input!r}"
            )
        if self.encoder_input == "audio" and self.num_mel_bins <= 0:
            raise ValueError(f"num_mel_bins must be positive, got {self.num_mel_bins}")

    @classmethod
    def from_pretrained(cls, model_dir: Path) -> ModelArchConfig:
        """Reads `model_dir/config.json` and, when present, `generation_config.json`."""
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{model_dir} has no config.json; is it an HF checkpoint directory?")
        raw = _read_json(config_path)
        gen_path = model_dir / "generation_config.json"
        generation = _read_json(gen_path) if gen_path.is_file() else {}
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelArchConfig:
        """Builds the config from parsed `config.json` (and generation config) dicts."""
        generation = generation or {}
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no 'architectures' entry naming the model class")
        if raw.get("is_encoder_decoder"):
            return cls._from_encoder_decoder_dict(raw, generation)
        num_heads = int(_require(raw, "num_attention_heads"))
        hidden_size = int(_require(raw, "hidden_size"))
        rope_theta, rope_scaling = _rope_params(raw)
        eos_ids = _as_id_list(raw.get("eos_token_id")) + _as_id_list(generation.get("eos_token_id"))
        bos = raw.get("bos_token_id", generation.get("bos_token_id"))
        return cls(
            architecture=str(architectures[0]),
            num_layers=int(_require(raw, "num_hidden_layers")),
            hidden_size=hidden_size,
            intermediate_size=int(_require(raw, "intermediate_size")),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_size=int(raw.get("head_dim") or hidden_size // num_heads),
            vocab_size=int(_require(raw, "vocab_size")),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            hidden_act=str(raw.get("hidden_act", "silu")),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            raw={**raw, "generation_config": generation},
        )

    @classmethod
    def _from_encoder_decoder_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any]
    ) -> ModelArchConfig:
        """BART and Whisper: the generic fields describe the decoder (whose layers own the
        KV cache), the encoder fields the encoder; `raw` keeps the encoder's head count and
        feed-forward size (`encoder_attention_heads`, `encoder_ffn_dim`)."""
        hidden_size = int(_require(raw, "d_model"))
        _check_encoder_decoder_sizes(raw, hidden_size)
        num_heads = int(raw["decoder_attention_heads"])
        # Whisper states each side's positions; BART one length for both.
        max_positions = raw.get("max_position_embeddings")
        decoder_positions = raw.get("max_target_positions", max_positions)
        encoder_positions = raw.get("max_source_positions", max_positions)
        if decoder_positions is None or encoder_positions is None:
            raise ValueError(
                "config.json lacks the required field 'max_position_embeddings' "
                "(or 'max_target_positions' and 'max_source_positions')"
            )
        eos_ids = _as_id_list(raw.get("eos_token_id")) + _as_id_list(generation.get("eos_token_id"))
        bos = raw.get("bos_token_id", generation.get("bos_token_id"))
        # generate() reads the generation config's start token first, as this does.
        start = generation.get("decoder_start_token_id", raw.get("decoder_start_token_id"))
        is_audio = "num_mel_bins" in raw
        return cls(
            architecture=str(raw["architectures"][0]),
            num_layers=int(_require(raw, "decoder_layers")),
            hidden_size=hidden_size,
            intermediate_size=int(_require(raw, "decoder_ffn_dim")),
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_size=hidden_size // num_heads,
            vocab_size=int(_require(raw, "vocab_size")),
            max_position_embeddings=int(decoder_positions),
            # The layer norms' epsilon (the reference's nn.LayerNorm default); no rope.
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            rope_scaling=None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            attention_bias=True,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            hidden_act=str(raw.get("activation_function", "gelu")),
            mlp_bias=True,
            is_encoder_decoder=True,
            encoder_input="audio" if is_audio else "tokens",
            num_encoder_layers=int(_require(raw, "encoder_layers")),
            max_encoder_positions=int(encoder_positions),
            decoder_start_token_id=None if start is None else int(start),
            num_mel_bins=int(raw["num_mel_bins"]) if is_audio else 0,
            raw={**raw, "generation_config": generation},
        )
