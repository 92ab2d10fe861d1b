"""The golden tiny S2 model as the engine tests load it: a context long enough for their prompts
and references, and RoPE tables built for it on the model's device."""

from __future__ import annotations

from pathlib import Path

import torch

from shoal.models import load_model


def tiny_s2(golden_dir: Path, dtype: torch.dtype, max_seq_len: int = 256, device: str = "cpu"):
    """`../shared/golden/s2_tiny` in `dtype` on `device` with `max_seq_len` positions."""
    model = load_model(golden_dir / "s2_tiny", device=device, dtype=dtype)
    model.config = model.config.replace(max_seq_len=max_seq_len)
    model.build_rope_tables(device)
    return model
