"""Write checkpoint directories in each official layout, from a config and a state dict.

Used by tests (round trips through the real loader) and by `shoal demo-checkpoint`. Random
weights come from a seeded generator, so a (config, seed) pair always writes the same model.
The tokenizers written are byte-level (every byte one token, no merges) plus the family's special
and `<|semantic:i|>` tokens at the ids the config expects, enough to encode any text.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from shoal.models.checkpoint import PTH_FILE, S2_INDEX_FILE, build_model, native_to_file_key
from shoal.models.config import Family, ModelConfig, to_official_dict
from shoal.models.layers import RMSNorm
from shoal.models.tokenizer import S1_SPECIAL_TOKENS, semantic_token, v15_special_tokens

# S2's Fish/Qwen specials, written before the semantic tokens.
S2_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|phoneme_start|>", "<|phoneme_end|>",
    "<|text|>", "<|voice|>", "<|interleave|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
]  # fmt: skip


def tiny_config(family: Family) -> ModelConfig:
    """A few-hundred-kB model of the given family, for tests and demos."""
    common = dict(
        dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=160, max_seq_len=256,
        rope_base=1000000, norm_eps=1e-6, num_codebooks=4, n_fast_layer=2, fast_intermediate_size=96,
        initializer_range=0.1, family=family,
    )  # fmt: skip
    if family == "s2":
        return ModelConfig(
            model_type="fish_qwen3_omni", vocab_size=512, head_dim=32, codebook_size=64, fast_head_dim=16,
            attention_qk_norm=True, fast_attention_qk_norm=False, scale_codebook_embeddings=True,
            norm_fastlayer_input=True, tie_word_embeddings=True, semantic_begin_id=400, semantic_end_id=463,
            im_end_id=7, **common,
        )  # fmt: skip
    if family == "s1":
        return ModelConfig(
            vocab_size=352,  # 256 bytes + 15 specials + 64 semantic, padded
            head_dim=32,
            codebook_size=64,
            fast_head_dim=16,
            attention_qk_norm=True,
            fast_attention_qk_norm=False,
            scale_codebook_embeddings=True,
            tie_word_embeddings=False,
            **common,
        )
    # 1.5: head_dim is dim // n_head; its tokenizer always has 1024 semantic tokens.
    return ModelConfig(vocab_size=1296, codebook_size=64, tie_word_embeddings=False, **common)


def tensor_plan(config: ModelConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(native name, shape, init) for every tensor the loader expects; init is "ones" (norm
    weights), "zeros" (biases) or "normal" (N(0, initializer_range))."""
    model = build_model(config)  # meta device: shapes only
    norms = {
        f"{name}.weight" for name, module in model.named_modules() if isinstance(module, RMSNorm | nn.RMSNorm)
    }
    plan = []
    for name, param in model.state_dict().items():
        init = "ones" if name in norms else "zeros" if name.endswith(".bias") else "normal"
        plan.append((name, tuple(param.shape), init))
    return plan


def random_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, Tensor]:
    """Native-named fp32 weights: N(0, initializer_range) matrices, zero biases, unit norms."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape, init in tensor_plan(config):
        if init == "normal":
            state[name] = torch.empty(shape).normal_(0.0, config.initializer_range, generator=generator)
        else:
            state[name] = torch.ones(shape) if init == "ones" else torch.zeros(shape)
    return state


# ---- tokenizer files ------------------------------------------------------------------------


def _byte_level_alphabet() -> list[str]:
    """The printable character GPT-2-style byte-level BPE uses for each byte value 0..255."""
    printable = [
        *range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1),
    ]  # fmt: skip
    chars = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _s2_token_ids(config: ModelConfig, extra_ids: dict[str, int]) -> dict[str, int]:
    """Specials at the ids the config fixes (im_end, pad, audio_pad, semantic range), the other
    specials and then the 256 bytes at the lowest free ids."""
    fixed = {semantic_token(i): config.semantic_begin_id + i for i in range(config.codebook_size)}
    fixed["<|im_end|>"] = config.im_end_id
    fixed.update(extra_ids)
    taken = set(fixed.values())
    ids = dict(fixed)
    free = (i for i in range(config.vocab_size) if i not in taken)
    for token in [t for t in S2_SPECIAL_TOKENS if t not in fixed] + _byte_level_alphabet():
        ids[token] = next(free)
    return ids


def write_s2_tokenizer(directory: Path, config: ModelConfig, extra_ids: dict[str, int]) -> None:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    ids = _s2_token_ids(config, extra_ids)
    tokenizer = RustTokenizer(models.BPE(vocab=ids, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = sorted((i, t) for t, i in ids.items() if t.startswith("<|"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in specials])
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
    }  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))


def write_tiktoken_ranks(path: Path) -> int:
    """One rank per byte value; returns the number of ranks."""
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 256


def write_tiktoken_tokenizer(directory: Path, config: ModelConfig) -> list[str]:
    """tokenizer.tiktoken (+ special_tokens.json for S1, whose ids follow its key order);
    returns the special tokens in id order."""
    ranks = write_tiktoken_ranks(directory / "tokenizer.tiktoken")
    if config.family == "s1":
        specials = [*S1_SPECIAL_TOKENS, *(semantic_token(i) for i in range(config.codebook_size))]
        mapping = {token: ranks + i for i, token in enumerate(specials)}
        (directory / "special_tokens.json").write_text(json.dumps(mapping, indent=2), encoding="utf-8")
    else:
        specials = v15_special_tokens()
    return specials


# ---- the checkpoint -------------------------------------------------------------------------


def _write_s2_weights(directory: Path, state: dict[str, Tensor], num_shards: int) -> None:
    from safetensors.torch import save_file

    file_state = {native_to_file_key(k, "s2"): v.contiguous() for k, v in state.items()}
    keys = list(file_state)
    num_shards = max(1, min(num_shards, len(keys)))
    per_shard = -(-len(keys) // num_shards)
    weight_map, total_size = {}, 0
    for shard_index in range(num_shards):
        name = f"model-{shard_index + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {k: file_state[k] for k in keys[shard_index * per_shard : (shard_index + 1) * per_shard]}
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        total_size += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / S2_INDEX_FILE).write_text(json.dumps(index, indent=2))


def write_checkpoint(
    directory: str | Path, config: ModelConfig, state_dict: dict[str, Tensor] | None = None, *, seed: int = 0,
    dtype: torch.dtype = torch.bfloat16, num_shards: int = 2, lightning_wrapped: bool = False,
) -> ModelConfig:  # fmt: skip
    """Write `config` + weights (native names; random with `seed` when None) + tokenizer files
    as the official layout of `config.family`. Returns the config `load_model` will produce
    (special ids as the written tokenizer assigns them). `lightning_wrapped` writes a flat
    model.pth as `{"state_dict": {"model.<key>": ...}}`, as training checkpoints are."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = random_state_dict(config, seed) if state_dict is None else state_dict
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    if config.family == "s2":
        extra_ids = {}
        free = (i for i in range(config.vocab_size - 1, -1, -1))
        taken = {config.im_end_id, *range(config.semantic_begin_id, config.semantic_end_id + 1)}
        for name in ("<|pad|>", "<|audio_pad|>"):
            extra_ids[name] = next(i for i in free if i not in taken)
        write_s2_tokenizer(directory, config, extra_ids)
        official = to_official_dict(config, {"pad_token_id": extra_ids["<|pad|>"]})
        official["audio_pad_token_id"] = extra_ids["<|audio_pad|>"]
        _write_s2_weights(directory, state, num_shards)
        result = config
    else:
        specials = write_tiktoken_tokenizer(directory, config)
        begin = 256 + specials.index(semantic_token(0))
        semantic_count = sum(1 for t in specials if t.startswith("<|semantic:"))
        result = config.replace(
            semantic_begin_id=begin, semantic_end_id=begin + semantic_count - 1,
            im_end_id=256 + specials.index("<|im_end|>"),
        )  # fmt: skip
        if result.semantic_end_id >= config.vocab_size:
            raise ValueError(f"vocab_size {config.vocab_size} cannot hold the {config.family} tokenizer")
        official = to_official_dict(config)
        payload: dict = state
        if lightning_wrapped:
            payload = {"state_dict": {f"model.{k}": v for k, v in state.items()}}
        torch.save(payload, directory / PTH_FILE)
    (directory / "config.json").write_text(json.dumps(official, indent=2), encoding="utf-8")
    return result
