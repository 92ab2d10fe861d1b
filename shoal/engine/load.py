"""`load_engine`: checkpoint directory (or hub id) -> a ready `LocalEngine` (the server's factory)."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from shoal.config import WEIGHT_FORMATS, EngineConfig

log = logging.getLogger("shoal.engine.load")


def is_fp8_checkpoint(checkpoint: str | Path) -> bool:
    """Whether `checkpoint` is a local directory written by `shoal quantize`."""
    import json

    config = Path(checkpoint) / "config.json"
    if not config.is_file():
        return False
    try:
        return isinstance(json.loads(config.read_text(encoding="utf-8")).get("quantization"), dict)
    except (OSError, json.JSONDecodeError):
        return False


def fp8_validates_here(device: str, dtype: str) -> bool:
    """Whether "auto" checks FP8 at load: a Hopper (or newer) GPU running bf16, where the FP8
    kernels are built and tuned; elsewhere "auto" keeps bf16."""
    import torch

    if not device.startswith("cuda") or dtype != "bfloat16" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(torch.device(device)) >= (9, 0)


def load_engine_model(
    checkpoint: str | Path,
    device: str,
    dtype: str,
    weight_format: str | None = None,
    validate_fp8: bool | None = None,
):
    """(model, weight format) for the engine. An FP8 checkpoint (`shoal quantize`) loads through
    `quant.fp8_linear.load_quantized`, which verifies every layer's scale layout; with
    `weight_format="fp8"` a bf16 checkpoint is quantized in place (`engine.fp8_weights.prepare_model`,
    same checks). "auto" (or None): "fp8" for an FP8 checkpoint; for a bf16 one, FP8 where its greedy
    frames equal bf16's on these weights (`engine.fp8_validation`; checked when `validate_fp8`, by
    default on a Hopper GPU in bf16), else "bf16", with the reason logged."""
    import torch

    fp8_checkpoint = is_fp8_checkpoint(checkpoint)
    if weight_format not in (None, "auto", *WEIGHT_FORMATS):
        raise ValueError(f"weight_format must be auto or one of {WEIGHT_FORMATS}, got {weight_format!r}")
    torch_dtype = getattr(torch, dtype)
    if fp8_checkpoint:
        if weight_format == "bf16":
            raise ValueError(f"{checkpoint} is an FP8 checkpoint: weight_format must be 'fp8'")
        from shoal.quant.fp8_linear import load_quantized

        return load_quantized(checkpoint, device=device, dtype=torch_dtype, verify=True), "fp8"
    from shoal.models import load_model

    model = load_model(str(checkpoint), device=device, dtype=torch_dtype)
    if weight_format in (None, "auto"):
        if validate_fp8 is None:
            validate_fp8 = fp8_validates_here(device, dtype)
        if not validate_fp8:
            return model, "bf16"
        from shoal.engine.fp8_validation import quantize_if_validated

        result = quantize_if_validated(model)
        if result.passed:
            log.info("serving FP8 weights: they decode what bf16 decodes (%s)", result.report())
            return model, "fp8"
        log.warning(
            "serving bf16 weights: FP8 did not validate on this checkpoint (%s); "
            "--weight-format fp8 serves FP8 anyway",
            result.report(),
        )
        del model
        return load_model(str(checkpoint), device=device, dtype=torch_dtype), "bf16"
    if weight_format == "fp8":
        from shoal.engine.fp8_weights import prepare_model

        prepare_model(model)
    return model, weight_format


def load_engine(
    checkpoint: str | Path,
    *,
    codec: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    config: EngineConfig | None = None,
    weight_format: str | None = None,
    warmup: bool = True,
    validate_fp8: bool | None = None,
):
    """Load the model (`shoal.models.load_model`) and the codec (`codec.pth`, or 1.5's Firefly
    generator, inside the checkpoint directory unless `codec` names another file or directory:
    `models.codec.codec_file`) and return a
    `LocalEngine` ready for `start()`. Defaults: CUDA with bfloat16 when a GPU is present,
    else the CPU with float32. `weight_format` ("auto" | "bf16" | "fp8"; default: the config's when
    a config is given and not bf16, else "auto": `load_engine_model`, FP8 where it validates) sets
    `EngineConfig.weight_format`; "fp8" on a bf16 checkpoint quantizes it at load. With
    `warmup` (the default) synthetic requests run through prefill, decode and the vocoder
    before it returns (`LocalEngine.warmup`: first-use compilation and searches happen here,
    not in the first clients' requests; it leaves the engine idle and empty).

    `checkpoint` may be a Hugging Face repo id: it is resolved to its local snapshot once, and
    the codec is looked up there. A given `config` keeps its settings but takes the resolved
    `device` and `dtype`, so the model, the codec and the engine always agree."""
    import torch

    from shoal.engine.engine import LocalEngine
    from shoal.models.checkpoint import resolve_checkpoint_dir
    from shoal.models.codec import codec_file, load_codec

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if weight_format is None and config is not None and config.weight_format != "bf16":
        weight_format = config.weight_format
    checkpoint_dir = resolve_checkpoint_dir(checkpoint)
    started = time.perf_counter()
    model, weight_format = load_engine_model(checkpoint_dir, device, dtype, weight_format, validate_fp8)
    weights = "FP8" if weight_format == "fp8" else dtype
    log.info("model loaded in %.1f s (%s weights on %s)", time.perf_counter() - started, weights, device)
    codec_path = Path(codec) if codec is not None else codec_file(checkpoint_dir)
    if not codec_path.exists():
        raise FileNotFoundError(f"no codec at {codec_path} (pass codec=...)")
    codec_model = load_codec(codec_path, device=device, dtype=getattr(torch, dtype))
    config = config or EngineConfig()
    config = dataclasses.replace(config, device=device, dtype=dtype, weight_format=weight_format)
    name = Path(str(checkpoint)).name or "s2-pro"
    engine = LocalEngine(model, config, codec=codec_model, model_name=name)
    if warmup:
        engine.warmup()
    return engine
