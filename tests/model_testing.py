"""The golden tiny S2 model as the engine tests load it (a context long enough for their prompts
and references, RoPE tables built on the model's device), and staggered traffic through an
engine core, whose frames two engine settings must agree on."""

from __future__ import annotations

from pathlib import Path

import torch

from shoal.models import load_model


def tiny_s2(golden_dir: Path, dtype: torch.dtype, max_seq_len: int = 256, device: str = "cpu"):
    """`tests/golden/s2_tiny` in `dtype` on `device` with `max_seq_len` positions."""
    model = load_model(golden_dir / "s2_tiny", device=device, dtype=dtype)
    model.config = model.config.replace(max_seq_len=max_seq_len)
    model.build_rope_tables(device)
    return model


def staggered_request_frames(core, seed: int, frames: int = 12, concurrency: int = 3) -> list[torch.Tensor]:
    """Seven prompts of 20-74 tokens through `bench.engine.run_closed_loop` (at most one new
    request per step, so prefill and decode share steps at changing batch sizes): each request's
    frames, in submission order."""
    from shoal.bench.engine import make_prompts, run_closed_loop

    prompts = [p[:, : 20 + 9 * i] for i, p in enumerate(make_prompts(core.model, 7, 80, 0, seed=seed))]
    requests = []
    add = core.add

    def keep(request, *args, **kwargs):
        add(request, *args, **kwargs)
        requests.append(request)

    core.add = keep
    run_closed_loop(core, prompts, frames, concurrency, 0)
    return [r.frames[: r.num_frames].clone() for r in requests]
