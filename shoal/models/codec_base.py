"""What both codecs (the modded DAC in `codec.py`, Fish Speech 1.5's Firefly in
`codec_firefly.py`) share: the too-short-clip error and the official checkpoint layout (weight
norm folded on load, random weights written in it). Imports no codec module, so every codec
module can import it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor, nn


class AudioTooShortError(ValueError):
    """A clip too short for a codec to encode (Fish Speech 1.5's log-mel needs a few ms): the
    caller's bad input, which the engine reports as an invalid request, not a fault."""


def weight_normed(model: nn.Module) -> dict[str, nn.Module]:
    """Convolutions whose official file stores the weight as a weight-norm pair, by module name."""
    return {name: m for name, m in model.named_modules() if getattr(m, "weight_norm", None)}


def official_layout(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape the official `codec.pth` holds for this model."""
    normed = weight_normed(model)
    layout: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if owner in normed and leaf == "weight":
            g_shape = (param.shape[0],) + (1,) * (param.dim() - 1)
            if normed[owner].weight_norm == "legacy":
                layout[f"{owner}.weight_g"], layout[f"{owner}.weight_v"] = g_shape, tuple(param.shape)
            else:
                layout[f"{owner}.parametrizations.weight.original0"] = g_shape
                layout[f"{owner}.parametrizations.weight.original1"] = tuple(param.shape)
        else:
            layout[name] = tuple(param.shape)
    return layout


def read_codec_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Load codec.pth as shipped: plain or {"state_dict": ...}, with or without `generator.`."""
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if any(key.startswith("generator.") for key in state):
        state = {key[len("generator.") :]: v for key, v in state.items() if key.startswith("generator.")}
    return dict(state)


def fold_state_dict(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Map an official state dict onto `model`'s parameters, folding weight norm; strict.

    Each weight-normed conv may be stored as parametrizations (original0/1), legacy weight_g/v,
    or an already-folded `weight`. Raises ValueError naming every missing, unexpected or
    mis-shaped tensor."""
    remaining, folded, problems = dict(state), {}, []
    expected = dict(model.named_parameters())
    forms = (
        ("parametrizations.weight.original0", "parametrizations.weight.original1"),
        ("weight_g", "weight_v"),
    )
    for owner in weight_normed(model):
        key = f"{owner}.weight"
        for g_name, v_name in forms:
            if f"{owner}.{g_name}" in remaining and f"{owner}.{v_name}" in remaining:
                g, v = remaining.pop(f"{owner}.{g_name}"), remaining.pop(f"{owner}.{v_name}")
                if v.shape != expected[key].shape or g.numel() != v.shape[0]:
                    stored = f"{v_name} {tuple(v.shape)} / {g_name} {tuple(g.shape)}"
                    problems.append(
                        f"mis-shaped: {owner}.{stored}, expected weight {tuple(expected[key].shape)}"
                    )
                else:
                    remaining[key] = torch._weight_norm(v.float(), g.float(), 0)
                break
    for key, param in expected.items():
        if key not in remaining:
            problems.append(f"missing: {key}")
        elif remaining[key].shape != param.shape:
            problems.append(f"mis-shaped: {key} {tuple(remaining[key].shape)}, expected {tuple(param.shape)}")
            remaining.pop(key)
        else:
            folded[key] = remaining.pop(key)
    problems += [f"unexpected: {key}" for key in sorted(remaining)]
    if problems:
        raise ValueError("codec checkpoint does not match the codec config:\n  " + "\n  ".join(problems))
    return folded


# Slightly contracting layers: random audio stays well inside tanh (std ~0.3), so the float32
# rounding noise is not amplified and streaming-vs-full comparisons at 1e-5 are meaningful.
RANDOM_WEIGHT_GAIN = 0.7


def random_weights(codec: nn.Module, seed: int = 0, legacy: bool = False) -> dict[str, Tensor]:
    """Random weights for a codec module (built on any device, the meta one included) in the
    official layout: weight-normed convs as (g, v) pairs, parametrizations or `legacy` names."""
    gen = torch.Generator().manual_seed(seed)
    normed = weight_normed(codec)
    state: dict[str, Tensor] = {}
    for name, param in codec.named_parameters():
        owner, _, leaf = name.rpartition(".")
        module = codec.get_submodule(owner)
        shape = tuple(param.shape)
        if leaf == "alpha":
            value = 0.5 + torch.rand(shape, generator=gen)
        elif leaf == "gamma":
            value = torch.full(shape, 0.1)
        elif isinstance(module, nn.Embedding):
            value = torch.randn(shape, generator=gen)
        elif leaf == "bias":
            value = 0.0 if isinstance(module, nn.LayerNorm) else 0.01 * torch.randn(shape, generator=gen)
            value = torch.zeros(shape) + value
        elif leaf == "weight" and param.dim() == 1:  # RMSNorm / LayerNorm
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            # fan-in scaling keeps activations O(1); a transposed conv's fan-in is C_in * K / stride
            fan_in = (
                shape[0] * shape[2] / module.stride[0] if isinstance(module, nn.ConvTranspose1d) else None
            )
            value = (
                RANDOM_WEIGHT_GAIN
                * torch.randn(shape, generator=gen)
                / math.sqrt(fan_in or math.prod(shape[1:]))
            )
        if owner in normed and leaf == "weight":
            norm = value.flatten(1).norm(dim=1).view(-1, *([1] * (value.dim() - 1)))
            v = value * (0.5 + torch.rand(norm.shape, generator=gen))  # the direction; g the length
            if legacy or normed[owner].weight_norm == "legacy":
                g_name, v_name = "weight_g", "weight_v"
            else:
                g_name, v_name = "parametrizations.weight.original0", "parametrizations.weight.original1"
            state[f"{owner}.{g_name}"], state[f"{owner}.{v_name}"] = norm.clone(), v
        else:
            state[name] = value
    return state
