"""The FP8 block-scaled checkpoint: how weights are quantized and how they are laid out on disk.

A quantized checkpoint directory (docs/quantization.md) is the source directory's non-weight files
(tokenizer, codec, ...) plus:
- `config.json`: the source config with a `"quantization"` section (`quantization_section`);
- `model.safetensors`: native-named tensors (`layers.0.attention.wqkv.weight`, ...). Each quantized
  linear has `weight` e4m3 [N, K], `weight_scale` fp32 [ceil(N/128), ceil(K/128)] row-major
  (`scale[n // 128, k // 128]`, exactly what `kernels/fp8_gemm.py` indexes) and `weight_probe`
  fp32 [N]: dequant(weight) @ probe_input(K), computed in float64 when quantizing. Loading
  recomputes the probe through the layer's own forward path, which catches any scale layout the
  kernel would misread (transposed, re-strided, swapped between layers).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from shoal.kernels import reference

FORMAT = "fp8_block"
FORMAT_VERSION = 1
WEIGHT_BLOCK = (128, 128)
ACTIVATION_GROUP = 128
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Files of a source checkpoint that hold the float weights this directory replaces.
_WEIGHT_FILES = ("model.pth", "model.safetensors", "model.safetensors.index.json")
_SHARD_PREFIX = "model-"


class QuantizedCheckpointError(RuntimeError):
    """A directory that is not an FP8 checkpoint this version of Shoal can read."""


def probe_input(k: int, device: torch.device | str = "cpu") -> Tensor:
    """A fixed +-1 vector [K]: exact in bf16 and in e4m3 after per-128 quantization (amax 1), so a
    probe through any activation mode measures only the weight path."""
    index = torch.arange(k, dtype=torch.int64, device=device)
    bits = ((index * 2654435761 + 12345) >> 13) & 1  # a fixed, hash-like sign pattern
    return (1 - 2 * bits).to(torch.float32)


def weight_probe(w_q: Tensor, w_scale: Tensor) -> Tensor:
    """dequant(w) @ probe_input in float64, stored as fp32 [N]."""
    dequantized = reference.dequantize_weight(w_q, w_scale).double()
    return (dequantized @ probe_input(w_q.shape[1], w_q.device).double()).float()


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float [N, K] -> (e4m3 [N, K], fp32 scales [ceil(N/128), ceil(K/128)], probe fp32 [N])."""
    w_q, w_scale = reference.quantize_weight(weight.detach())
    return w_q, w_scale, weight_probe(w_q, w_scale)


def quantization_section(modules: list[str], quantize_input: bool) -> dict[str, Any]:
    """The `"quantization"` entry of config.json."""
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "weight_dtype": "float8_e4m3fn",
        "weight_block": list(WEIGHT_BLOCK), "scale_dtype": "float32",
        "scale_layout": "row_major[ceil(out/128), ceil(in/128)]", "activation_group": ACTIVATION_GROUP,
        "quantize_activations": quantize_input, "modules": modules,
    }  # fmt: skip


def read_quantization_section(directory: str | Path) -> dict[str, Any]:
    """The checked `"quantization"` section of a quantized checkpoint's config.json."""
    path = Path(directory) / CONFIG_FILE
    try:
        section = json.loads(path.read_text(encoding="utf-8")).get("quantization")
    except (OSError, json.JSONDecodeError) as error:
        raise QuantizedCheckpointError(f"{path}: {error}") from error
    if not isinstance(section, dict):
        raise QuantizedCheckpointError(f"{path} has no quantization section: not an FP8 checkpoint")
    if section.get("format") != FORMAT or section.get("version") != FORMAT_VERSION:
        raise QuantizedCheckpointError(
            f"{path}: quantization format {section.get('format')} v{section.get('version')}, "
            f"this Shoal reads {FORMAT} v{FORMAT_VERSION}"
        )
    if list(section.get("weight_block", [])) != list(WEIGHT_BLOCK):
        raise QuantizedCheckpointError(f"{path}: weight block {section.get('weight_block')} unsupported")
    return section


def write_quantized_checkpoint(
    source: str | Path, out: str | Path, state: dict[str, Tensor], modules: list[str], quantize_input: bool,
) -> Path:  # fmt: skip
    """Write `state` (native names) + config with a quantization section + the source's other files."""
    from safetensors.torch import save_file

    source, out = Path(source), Path(out)
    if out.resolve() == source.resolve():
        raise ValueError("the output directory must differ from the source checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name in _WEIGHT_FILES or item.name == CONFIG_FILE:
            continue
        if item.name.startswith(_SHARD_PREFIX) and item.name.endswith(".safetensors"):
            continue
        target = out / item.name
        if item.is_dir():
            shutil.copytree(item, target, dirs_exist_ok=True)
        else:
            shutil.copy2(item, target)
    config = json.loads((source / CONFIG_FILE).read_text(encoding="utf-8"))
    config["quantization"] = quantization_section(modules, quantize_input)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
    contiguous = {name: tensor.detach().contiguous().cpu() for name, tensor in state.items()}
    save_file(contiguous, str(out / WEIGHTS_FILE), metadata={"format": "pt", "shoal_quantization": FORMAT})
    return out


def read_quantized_state(directory: str | Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    path = Path(directory) / WEIGHTS_FILE
    if not path.exists():
        raise QuantizedCheckpointError(f"{path} not found")
    return load_file(str(path))
