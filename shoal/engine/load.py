"""`load_engine`: checkpoint directory (or hub id) -> a ready `LocalEngine` (the server's factory)."""

from __future__ import annotations

from pathlib import Path

from shoal.config import EngineConfig


def load_engine(
    checkpoint: str | Path,
    *,
    codec: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    config: EngineConfig | None = None,
):
    """Load the model (`shoal.models.load_model`) and the codec (`codec.pth` inside the
    checkpoint directory unless `codec` names another file or directory) and return a
    `LocalEngine` ready for `start()`. Defaults: CUDA with bfloat16 when a GPU is present,
    else the CPU with float32."""
    import torch

    from shoal.engine.engine import LocalEngine
    from shoal.models import load_model
    from shoal.models.codec import load_codec

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    torch_dtype = getattr(torch, dtype)
    model = load_model(str(checkpoint), device=device, dtype=torch_dtype)
    codec_path = Path(codec) if codec is not None else Path(checkpoint) / "codec.pth"
    if not codec_path.exists():
        raise FileNotFoundError(f"no codec at {codec_path} (pass codec=...)")
    codec_model = load_codec(codec_path, device=device, dtype=torch_dtype)
    if config is None:
        config = EngineConfig(device=device, dtype=dtype)
    name = Path(str(checkpoint)).name or "s2-pro"
    return LocalEngine(model, config, codec=codec_model, model_name=name)
