"""Read official checkpoint directories unchanged and load them strictly.

Layouts:
- S2-Pro (`fish_qwen3_omni`): sharded safetensors + `model.safetensors.index.json`, keys
  `text_model.model.<native>` (slow model) and `audio_decoder.<x>` (fast model `fast_<x>`, except
  `audio_decoder.codebook_embeddings`, the slow model's codebook input table).
- S1-mini / 1.5 (`dual_ar`): `model.pth` with native keys, possibly wrapped in `{"state_dict": ...}`
  and prefixed `model.` (Lightning).

Unlike the reference (strict=False, which silently keeps random weights), every missing,
unexpected or mis-shaped tensor is an error naming the tensors. The one deliberate exception:
`.pth` keys containing `audio_` (the dead `audio_projector` path the reference also drops).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
from torch import Tensor

from shoal.models.config import ConfigError, ModelConfig, read_config
from shoal.models.dual_ar import DualARTransformer
from shoal.models.tokenizer import TokenizerError, load_tokenizer

logger = logging.getLogger(__name__)

S2_INDEX_FILE = "model.safetensors.index.json"
S2_SINGLE_FILE = "model.safetensors"
PTH_FILE = "model.pth"
_SLOW_PREFIX = "text_model.model."
_FAST_PREFIX = "audio_decoder."
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MAX_LISTED = 12


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded exactly as the model needs it."""


# ---- locating the directory ---------------------------------------------------------------


def resolve_checkpoint_dir(path_or_repo: str | Path) -> Path:
    """A local directory as is; otherwise a Hugging Face repo id: the local cache first, then a
    download. HF_HUB_CACHE is read at call time."""
    local = Path(path_or_repo).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise CheckpointError(f"{local} is a file; expected a checkpoint directory")
    repo_id = str(path_or_repo)
    if not _REPO_ID.match(repo_id):
        raise CheckpointError(f"{repo_id}: no such directory, and not a Hugging Face repo id")
    from huggingface_hub import snapshot_download

    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except Exception as cache_error:  # noqa: BLE001 - any failure means "not usable from cache"
        logger.info("%s not in the Hugging Face cache (%s); downloading", repo_id, cache_error)
        try:
            return Path(snapshot_download(repo_id, cache_dir=cache_dir))
        except Exception as download_error:  # noqa: BLE001
            raise CheckpointError(
                f"{repo_id} is not a local directory, not in the Hugging Face cache, and could not be "
                f"downloaded: {type(download_error).__name__}: {download_error}"
            ) from download_error


# ---- key naming -----------------------------------------------------------------------------


def native_to_file_key(name: str, family: str) -> str:
    """Native module name -> the key the official files use for this family."""
    if family != "s2":
        return name
    if name.startswith("codebook_embeddings."):
        return _FAST_PREFIX + name
    if name.startswith("fast_"):
        return _FAST_PREFIX + name[len("fast_") :]
    return _SLOW_PREFIX + name


def file_to_native_key(key: str, family: str) -> str | None:
    """Official file key -> native module name; None when the key has no place in the model."""
    if family != "s2":
        return key
    if key.startswith(_SLOW_PREFIX):
        return key[len(_SLOW_PREFIX) :]
    if key.startswith(_FAST_PREFIX):
        rest = key[len(_FAST_PREFIX) :]
        return rest if rest.startswith("codebook_embeddings.") else "fast_" + rest
    return None


# ---- reading weight files -------------------------------------------------------------------


def _read_safetensors(path: Path, device: str | torch.device) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot read safetensors file: {error}") from error


def _s2_shards(directory: Path) -> list[tuple[Path, list[str]]]:
    """(shard path, keys the index assigns to it), checking the index and that shards exist."""
    index_path = directory / S2_INDEX_FILE
    if not index_path.exists():
        single = directory / S2_SINGLE_FILE
        if single.exists():
            return [(single, [])]
        raise CheckpointError(f"{directory}: neither {S2_INDEX_FILE} nor {S2_SINGLE_FILE} found")
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise CheckpointError(f"{index_path}: not a safetensors index ({error})") from None
    by_shard: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(key)
    missing = sorted(shard for shard in by_shard if not (directory / shard).exists())
    if missing:
        raise CheckpointError(f"{directory}: missing shard file(s) {missing} named in {S2_INDEX_FILE}")
    return [(directory / shard, keys) for shard, keys in sorted(by_shard.items())]


def _read_s2_files(directory: Path, device: str | torch.device) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {}
    for shard, indexed_keys in _s2_shards(directory):
        shard_tensors = _read_safetensors(shard, device)
        absent = sorted(set(indexed_keys) - set(shard_tensors))
        if absent:
            raise CheckpointError(f"{shard.name} lacks tensors its index assigns to it: {_listing(absent)}")
        tensors.update(shard_tensors)
    return tensors


def _read_pth(directory: Path) -> dict[str, Tensor]:
    path = directory / PTH_FILE
    if not path.exists():
        raise CheckpointError(f"{path} not found")
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle/zip errors come in many types
        raise CheckpointError(f"{path}: cannot read ({type(error).__name__}: {error})") from error
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]  # a Lightning checkpoint
    if not isinstance(loaded, dict) or not loaded:
        raise CheckpointError(f"{path}: expected a non-empty state dict")
    keys = list(loaded)
    if keys[0].startswith("model."):  # the reference decides on the first key, as here
        loaded = {k.removeprefix("model."): v for k, v in loaded.items()}
    # Deliberately ignored: the dead audio_projector path, which the reference drops as well.
    dropped = [k for k in loaded if "audio_" in k]
    if dropped:
        logger.info("ignoring %d unused audio_* tensors in %s", len(dropped), path)
    tensors = {k: v for k, v in loaded.items() if "audio_" not in k}
    not_tensors = sorted(k for k, v in tensors.items() if not isinstance(v, Tensor))
    if not_tensors:
        raise CheckpointError(f"{path}: entries that are not tensors: {_listing(not_tensors)}")
    return _fuse_legacy_qkv(tensors)


def _fuse_legacy_qkv(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Old checkpoints store wq/wk/wv separately; the model has one fused wqkv."""
    for key in [k for k in tensors if k.endswith(".wq.weight")]:
        prefix = key[: -len("wq.weight")]
        parts = [tensors.pop(prefix + f"{name}.weight", None) for name in ("wq", "wk", "wv")]
        if any(p is None for p in parts):
            raise CheckpointError(f"{prefix}wq/wk/wv: incomplete legacy attention weights")
        tensors[prefix + "wqkv.weight"] = torch.cat(parts)
    return tensors


def read_native_state_dict(
    directory: Path, family: str, device: str | torch.device = "cpu"
) -> dict[str, Tensor]:
    """All weight tensors of a checkpoint directory, under native names. Safetensors shards are
    read straight onto `device`; a .pth is memory-mapped on the CPU."""
    if family != "s2":
        return _read_pth(directory)
    tensors = _read_s2_files(directory, device)
    foreign = sorted(k for k in tensors if file_to_native_key(k, family) is None)
    if foreign:
        raise CheckpointError(
            f"{directory}: unexpected tensors outside {_SLOW_PREFIX}* and {_FAST_PREFIX}*: "
            + _listing(foreign)
        )
    return {file_to_native_key(k, family): v for k, v in tensors.items()}


# ---- strict loading -------------------------------------------------------------------------


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" ... ({len(names)} in all)" if len(names) > _MAX_LISTED else "")


def check_state_dict(model: DualARTransformer, state: dict[str, Tensor]) -> None:
    """Raise CheckpointError naming every missing, unexpected and mis-shaped tensor (in the
    file's own key naming)."""
    family = model.family
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    problems = []
    missing = sorted(native_to_file_key(k, family) for k in expected if k not in state)
    unexpected = sorted(native_to_file_key(k, family) for k in state if k not in expected)
    mismatched = sorted(
        f"{native_to_file_key(k, family)} {tuple(v.shape)} (expected {expected[k]})"
        for k, v in state.items()
        if k in expected and tuple(v.shape) != expected[k]
    )
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(unexpected)}")
    if mismatched:
        problems.append(f"wrong shapes: {_listing(mismatched)}")
    if problems:
        raise CheckpointError("checkpoint does not match the config: " + "; ".join(problems))


def build_model(config: ModelConfig, tokenizer: object = None) -> DualARTransformer:
    """The module tree on the meta device: shapes without memory or init cost."""
    with torch.device("meta"):
        return DualARTransformer(config, tokenizer)


def load_state_into(
    model: DualARTransformer, state: dict[str, Tensor], device: str | torch.device, dtype: torch.dtype
) -> DualARTransformer:
    """Strictly load native-named tensors into a (meta-built) model on `device` in `dtype`."""
    check_state_dict(model, state)
    placed = {
        k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in state.items()
    }
    model.load_state_dict(placed, strict=True, assign=True)
    model.build_rope_tables(device)
    return model.eval().requires_grad_(False)


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> DualARTransformer:
    """Load an official checkpoint directory (or Hugging Face repo id) unchanged."""
    directory = resolve_checkpoint_dir(path)
    try:
        config = read_config(directory)
        tokenizer = load_tokenizer(directory, config.family)
    except (ConfigError, TokenizerError) as error:
        raise CheckpointError(f"{directory}: {error}") from error
    if config.family == "s2" and config.semantic_begin_id not in (-1, tokenizer.semantic_begin_id):
        logger.warning(
            "config semantic_start_token_id %d differs from the tokenizer's %d; using the tokenizer's",
            config.semantic_begin_id, tokenizer.semantic_begin_id,
        )  # fmt: skip
    config = config.replace(
        semantic_begin_id=tokenizer.semantic_begin_id, semantic_end_id=tokenizer.semantic_end_id,
        im_end_id=tokenizer.im_end_id,
    )  # fmt: skip
    if config.semantic_end_id >= config.vocab_size:
        raise CheckpointError(
            f"{directory}: semantic token ids reach {config.semantic_end_id}, "
            f"beyond vocab_size {config.vocab_size}"
        )
    model = build_model(config, tokenizer)
    state = read_native_state_dict(directory, config.family, device)
    return load_state_into(model, state, device, dtype)
