"""Model configuration: one flat dataclass for all three DualAR families.

The official checkpoints ship two config shapes: a flat `dual_ar` config (Fish Speech 1.5,
OpenAudio S1-mini) and a nested `fish_qwen3_omni` config (S2-Pro). Both parse into the same
`ModelConfig`, whose defaults reproduce the reference's dataclass defaults and `__post_init__`
so that a config with absent fields means the same model here as there.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Family = Literal["s2", "s1", "1.5"]

S2_MODEL_TYPE = "fish_qwen3_omni"
FLAT_MODEL_TYPE = "dual_ar"


class ConfigError(ValueError):
    """A config.json that does not describe a supported DualAR model."""


def _round_up(n: int, multiple: int) -> int:
    return n if n % multiple == 0 else n + multiple - n % multiple


@dataclass
class ModelConfig:
    """Flat field names as in the official flat config; defaults as in the reference code."""

    model_type: str = FLAT_MODEL_TYPE
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: int | None = None
    n_local_heads: int = -1
    head_dim: int | None = 64
    rope_base: float = 10000
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    tie_word_embeddings: bool = True
    attention_qkv_bias: bool = False
    attention_o_bias: bool = False
    attention_qk_norm: bool = False
    codebook_size: int = 160
    num_codebooks: int = 4
    initializer_range: float = 0.02
    scale_codebook_embeddings: bool = False
    # Fast ("depth") transformer; None means "same as the slow model".
    n_fast_layer: int = 4
    fast_dim: int | None = None
    fast_n_head: int | None = None
    fast_n_local_heads: int | None = None
    fast_head_dim: int | None = None
    fast_intermediate_size: int | None = None
    fast_attention_qkv_bias: bool | None = None
    fast_attention_qk_norm: bool | None = None
    fast_attention_o_bias: bool | None = None
    # S2 feeds the fast model the post-final-norm hidden state; S1 and 1.5 the pre-norm one.
    norm_fastlayer_input: bool = False
    # Not in the flat files: which family, and the special ids the model itself needs.
    family: Family = "s1"
    semantic_begin_id: int = -1
    semantic_end_id: int = -1
    im_end_id: int = -1

    def __post_init__(self) -> None:
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = _round_up(int(2 * 4 * self.dim / 3), 256)
        if self.head_dim is None or self.family == "1.5":
            # The 1.5 code always derives head_dim from dim.
            self.head_dim = self.dim // self.n_head
        self.fast_dim = self.fast_dim or self.dim
        self.fast_n_head = self.fast_n_head or self.n_head
        self.fast_n_local_heads = self.fast_n_local_heads or self.n_local_heads
        self.fast_head_dim = self.fast_head_dim or self.head_dim
        self.fast_intermediate_size = self.fast_intermediate_size or self.intermediate_size
        if self.fast_attention_qkv_bias is None:
            self.fast_attention_qkv_bias = self.attention_qkv_bias
        if self.fast_attention_qk_norm is None:
            self.fast_attention_qk_norm = self.attention_qk_norm
        if self.fast_attention_o_bias is None:
            self.fast_attention_o_bias = self.attention_o_bias
        if self.n_head % self.n_local_heads or self.fast_n_head % self.fast_n_local_heads:
            raise ConfigError("n_head must be a multiple of n_local_heads (slow and fast)")

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


_FIELD_NAMES = {f.name for f in dataclasses.fields(ModelConfig)}
# Flat-config keys the reference accepts but that mean nothing for inference, plus the
# "quantization" section an FP8 checkpoint (shoal/quant/fp8.py) adds to the source config.
_IGNORED_FLAT_KEYS = {
    "dropout", "use_gradient_checkpointing", "is_reward_model", "share_codebook_embeddings", "lora_config",
    "quantization",
}  # fmt: skip


def detect_family(raw: dict[str, Any], directory: Path | None = None) -> Family:
    """S2 by model_type; among flat `dual_ar` configs, S1-mini is the one with a
    special_tokens.json (and QK-norm / scaled codebook embeddings), 1.5 the one without."""
    model_type = raw.get("model_type")
    if model_type == S2_MODEL_TYPE:
        return "s2"
    if model_type != FLAT_MODEL_TYPE:
        raise ConfigError(
            f"unknown model_type {model_type!r}: expected {S2_MODEL_TYPE!r} (S2) or {FLAT_MODEL_TYPE!r} "
            "(OpenAudio S1-mini, Fish Speech 1.5)"
        )
    if directory is not None and (directory / "special_tokens.json").exists():
        return "s1"
    if raw.get("scale_codebook_embeddings") or raw.get("attention_qk_norm"):
        return "s1"
    return "1.5"


def _from_flat(raw: dict[str, Any], family: Family) -> ModelConfig:
    fields = {k: v for k, v in raw.items() if k in _FIELD_NAMES}
    unknown = set(raw) - _FIELD_NAMES - _IGNORED_FLAT_KEYS
    if unknown:
        raise ConfigError(f"unknown config fields {sorted(unknown)}")
    for key in ("family", "semantic_begin_id", "semantic_end_id", "im_end_id", "norm_fastlayer_input"):
        fields.pop(key, None)
    return ModelConfig(**fields, family=family)


def _from_nested(raw: dict[str, Any]) -> ModelConfig:
    """Flatten S2's text_config / audio_decoder_config the way the reference loader does."""
    try:
        text = raw["text_config"]
        audio = raw["audio_decoder_config"]
    except KeyError as missing:
        raise ConfigError(f"{S2_MODEL_TYPE} config lacks {missing}") from None

    if audio.get("use_moe") or text.get("use_moe"):
        raise ConfigError("mixture-of-experts DualAR variants are not supported")

    def pick(section: dict[str, Any], key: str, default: Any) -> Any:
        return section.get(key, default)

    defaults = ModelConfig()
    return ModelConfig(
        model_type=S2_MODEL_TYPE, vocab_size=text["vocab_size"], n_layer=text["n_layer"],
        n_head=text["n_head"], dim=text["dim"], intermediate_size=pick(text, "intermediate_size", None),
        n_local_heads=pick(text, "n_local_heads", -1), head_dim=pick(text, "head_dim", defaults.head_dim),
        rope_base=pick(text, "rope_base", defaults.rope_base),
        norm_eps=pick(text, "norm_eps", defaults.norm_eps),
        max_seq_len=pick(text, "max_seq_len", defaults.max_seq_len),
        tie_word_embeddings=pick(text, "tie_word_embeddings", True),
        attention_qkv_bias=pick(text, "attention_qkv_bias", False),
        attention_o_bias=pick(text, "attention_o_bias", False),
        attention_qk_norm=pick(text, "attention_qk_norm", False),
        initializer_range=pick(text, "initializer_range", defaults.initializer_range),
        codebook_size=audio["vocab_size"], num_codebooks=audio["num_codebooks"],
        n_fast_layer=audio["n_layer"], fast_dim=pick(audio, "dim", None),
        fast_n_head=pick(audio, "n_head", None), fast_n_local_heads=pick(audio, "n_local_heads", None),
        fast_head_dim=pick(audio, "head_dim", None),
        fast_intermediate_size=pick(audio, "intermediate_size", None),
        fast_attention_qkv_bias=pick(audio, "attention_qkv_bias", None),
        fast_attention_qk_norm=pick(audio, "attention_qk_norm", None),
        fast_attention_o_bias=pick(audio, "attention_o_bias", None), scale_codebook_embeddings=True,
        norm_fastlayer_input=True, family="s2", semantic_begin_id=raw.get("semantic_start_token_id", -1),
        semantic_end_id=raw.get("semantic_end_token_id", -1), im_end_id=raw.get("eos_token_id", -1),
    )  # fmt: skip


def parse_config(raw: dict[str, Any], directory: Path | None = None) -> ModelConfig:
    """Parse an official config.json dict (flat or nested) into a ModelConfig."""
    family = detect_family(raw, directory)
    try:
        return _from_nested(raw) if family == "s2" else _from_flat(raw, family)
    except (TypeError, KeyError) as error:
        raise ConfigError(f"malformed {raw.get('model_type')} config: {error}") from None


def read_config(directory: Path) -> ModelConfig:
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path} not found") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from None
    return parse_config(raw, Path(directory))


def to_official_dict(config: ModelConfig, extra_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """The config.json an official checkpoint of this family would carry (nested for S2)."""
    if config.family != "s2":
        flat = {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(config)
            if f.name not in ("family", "semantic_begin_id", "semantic_end_id", "im_end_id")
            and f.name != "norm_fastlayer_input"
        }
        flat["model_type"] = FLAT_MODEL_TYPE
        if config.family == "1.5":
            for key in ("attention_qk_norm", "scale_codebook_embeddings", "attention_o_bias"):
                flat.pop(key)
            for key in ("fast_attention_qk_norm", "fast_attention_o_bias"):
                flat.pop(key)
        return dict(sorted(flat.items()))
    text_config = {
        "model_type": "fish_qwen3", "dim": config.dim, "n_layer": config.n_layer, "n_head": config.n_head,
        "n_local_heads": config.n_local_heads, "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size, "max_seq_len": config.max_seq_len,
        "rope_base": config.rope_base, "norm_eps": config.norm_eps, "vocab_size": config.vocab_size,
        "attention_qk_norm": config.attention_qk_norm, "attention_qkv_bias": config.attention_qkv_bias,
        "attention_o_bias": config.attention_o_bias, "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range,
    }  # fmt: skip
    audio_decoder_config = {
        "model_type": "fish_qwen3_audio_decoder", "dim": config.fast_dim, "text_dim": config.dim,
        "n_layer": config.n_fast_layer, "n_head": config.fast_n_head,
        "n_local_heads": config.fast_n_local_heads, "head_dim": config.fast_head_dim,
        "intermediate_size": config.fast_intermediate_size, "max_seq_len": config.num_codebooks + 1,
        "num_codebooks": config.num_codebooks, "vocab_size": config.codebook_size,
        "rope_base": config.rope_base, "norm_eps": config.norm_eps,
        "attention_qk_norm": config.fast_attention_qk_norm,
        "attention_qkv_bias": config.fast_attention_qkv_bias,
        "attention_o_bias": config.fast_attention_o_bias, "tie_word_embeddings": False,
    }  # fmt: skip
    nested: dict[str, Any] = {
        "model_type": S2_MODEL_TYPE, "dtype": "bfloat16", "eos_token_id": config.im_end_id,
        "semantic_start_token_id": config.semantic_begin_id, "semantic_end_token_id": config.semantic_end_id,
    }  # fmt: skip
    nested.update(extra_ids or {})
    nested["text_config"] = text_config
    nested["audio_decoder_config"] = audio_decoder_config
    return nested
