"""`Fp8Linear`: the nn.Linear replacement that holds block-scaled FP8 weights, and the model-level
operations around it: quantize a loaded model in place, load a quantized checkpoint, and check at
load time that every scale tensor is laid out the way the kernel reads it.

On CUDA the forward calls `kernels/fp8_gemm.py`; elsewhere the torch reference computes the same
function. The load-time check matters: a transposed or re-strided scale tensor once made every GEMM
return wrong logits at full speed, with no error anywhere.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from shoal.kernels import reference
from shoal.quant import fp8

logger = logging.getLogger(__name__)

# Activations quantized (W8A8): at decode sizes the GEMM is about twice as fast as with weights
# dequantized in registers (W8A16).
DEFAULT_QUANTIZE_INPUT = True
# Relative error of the probe (+-1 input, exact in every activation mode) that a correct layout
# stays far below: only the bf16 rounding of the output (~1e-3) remains.
PROBE_TOLERANCE = 5e-3
# The transformer-block projections; embeddings, heads and norms stay in the model dtype.
QUANTIZED_MODULES = re.compile(
    r"^(layers|fast_layers)\.\d+\.(attention\.(wqkv|wo)|feed_forward\.(w1|w2|w3))$"
)


class LayoutError(RuntimeError):
    """FP8 weights or scales that the kernel would read wrongly."""


class Fp8Linear(nn.Module):
    """y = x @ dequant(weight).T (+ bias); weight e4m3 [N, K], weight_scale fp32 [N/128, K/128]."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False,
        quantize_input: bool = DEFAULT_QUANTIZE_INPUT, device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantize_input = quantize_input
        blocks = (-(-out_features // 128), -(-in_features // 128))
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        )
        self.register_buffer("weight_scale", torch.empty(blocks, dtype=torch.float32, device=device))
        self.register_buffer("weight_probe", torch.empty(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.empty(out_features, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, quantize_input: bool = DEFAULT_QUANTIZE_INPUT) -> Fp8Linear:
        layer = cls(
            linear.in_features, linear.out_features, linear.bias is not None, quantize_input,
            linear.weight.device,
        )  # fmt: skip
        w_q, w_scale, probe = fp8.quantize_weight(linear.weight.float())
        layer.weight.copy_(w_q)
        layer.weight_scale.copy_(w_scale)
        layer.weight_probe.copy_(probe)
        if linear.bias is not None:
            layer.bias = linear.bias.detach().clone()
        return layer

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, quantize_input={self.quantize_input}"

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if x.is_cuda:
            from shoal.kernels.fp8_gemm import fp8_linear

            out = fp8_linear(
                rows.to(torch.bfloat16).contiguous(), self.weight, self.weight_scale, self.quantize_input
            )
            out = out.to(x.dtype)
        else:
            out = reference.fp8_linear(
                rows, self.weight, self.weight_scale, self.quantize_input, out_dtype=x.dtype
            )
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def probe_error(self) -> float:
        """Relative error of this layer's forward on the probe input against the stored probe."""
        x = fp8.probe_input(self.in_features, self.weight.device)[None]
        dtype = torch.bfloat16 if self.weight.is_cuda else torch.float32
        y = self.forward(x.to(dtype)).float()[0]
        if self.bias is not None:
            y = y - self.bias.float()
        expected = self.weight_probe.float()
        return ((y - expected).norm() / expected.norm().clamp_min(1e-30)).item()

    def check_layout(self, name: str = "") -> None:
        """Raise LayoutError unless dtype, shape, strides and a numeric probe are all as the kernel needs."""
        where = name or "Fp8Linear"
        if self.weight.dtype != torch.float8_e4m3fn or tuple(self.weight.shape) != (
            self.out_features,
            self.in_features,
        ):
            raise LayoutError(
                f"{where}: weight must be float8_e4m3fn [{self.out_features}, {self.in_features}]"
            )
        if self.weight.stride(1) != 1:
            raise LayoutError(f"{where}: weight must have unit column stride, got {self.weight.stride()}")
        blocks = (-(-self.out_features // 128), -(-self.in_features // 128))
        scale = self.weight_scale
        if scale.dtype != torch.float32 or tuple(scale.shape) != blocks:
            raise LayoutError(
                f"{where}: weight_scale must be float32 {list(blocks)}, got {scale.dtype} {list(scale.shape)}"
            )
        if not scale.is_contiguous():
            raise LayoutError(
                f"{where}: weight_scale must be row-major contiguous, got strides {scale.stride()}"
            )
        if not torch.isfinite(scale).all() or (scale <= 0).any():
            raise LayoutError(f"{where}: weight_scale has non-positive or non-finite entries")
        error = self.probe_error()
        if not error < PROBE_TOLERANCE:  # also catches NaN
            raise LayoutError(
                f"{where}: probe matmul off by {error:.3g} (relative, limit {PROBE_TOLERANCE}): "
                "the scales are not laid out as the kernel reads them"
            )


def fp8_layers(model: nn.Module) -> list[tuple[str, Fp8Linear]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, Fp8Linear)]


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


@torch.no_grad()
def quantize_model_(model: nn.Module, quantize_input: bool = DEFAULT_QUANTIZE_INPUT) -> list[str]:
    """Replace every transformer-block projection with an Fp8Linear, in place; returns their names."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and QUANTIZED_MODULES.match(n)]
    for name in names:
        _set_submodule(model, name, Fp8Linear.from_linear(model.get_submodule(name), quantize_input))
    return names


def verify_model_layout(model: nn.Module) -> int:
    """Check every Fp8Linear (`Fp8Linear.check_layout`); returns how many were checked."""
    layers = fp8_layers(model)
    problems = []
    for name, layer in layers:
        try:
            layer.check_layout(name)
        except LayoutError as error:
            problems.append(str(error))
    if problems:
        shown = "; ".join(problems[:5]) + (
            f" ... ({len(problems)} layers in all)" if len(problems) > 5 else ""
        )
        raise LayoutError(shown)
    return len(layers)


def quantize_checkpoint(
    source: str | Path, out: str | Path, quantize_input: bool = DEFAULT_QUANTIZE_INPUT
) -> Path:
    """Read any checkpoint through `load_model`, quantize it, write the FP8 directory, and check it loads."""
    from shoal.models import load_model
    from shoal.models.checkpoint import resolve_checkpoint_dir

    directory = resolve_checkpoint_dir(source)
    model = load_model(directory, dtype=torch.bfloat16)
    modules = quantize_model_(model, quantize_input)
    verify_model_layout(model)
    written = fp8.write_quantized_checkpoint(directory, out, model.state_dict(), modules, quantize_input)
    logger.info("quantized %d linear layers of %s into %s", len(modules), directory, written)
    return written


def load_quantized(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
    verify: bool = True,
) -> nn.Module:  # fmt: skip
    """Load an FP8 checkpoint written by `quantize_checkpoint`; `verify` checks every layer's layout."""
    from shoal.models.checkpoint import build_model, load_state_into
    from shoal.models.config import read_config
    from shoal.models.tokenizer import load_tokenizer

    directory = Path(path)
    section = fp8.read_quantization_section(directory)
    config = read_config(directory)
    tokenizer = load_tokenizer(directory, config.family)
    config = config.replace(
        semantic_begin_id=tokenizer.semantic_begin_id, semantic_end_id=tokenizer.semantic_end_id,
        im_end_id=tokenizer.im_end_id,
    )  # fmt: skip
    model = build_model(config, tokenizer)
    for name in section["modules"]:
        linear = model.get_submodule(name)
        meta = Fp8Linear(
            linear.in_features, linear.out_features, linear.bias is not None, section["quantize_activations"],
            "meta",
        )  # fmt: skip
        _set_submodule(model, name, meta)
    state = fp8.read_quantized_state(directory)
    model = load_state_into(model, state, device, dtype)
    _restore_fp8_buffers(model, state, section["modules"], device)
    if verify:
        verify_model_layout(model)
    return model


def _restore_fp8_buffers(model: nn.Module, state: dict[str, Tensor], modules: list[str], device) -> None:
    """`load_state_into` casts every float tensor to the model dtype; put the FP8 buffers back as stored."""
    for name in modules:
        layer = model.get_submodule(name)
        for buffer in ("weight", "weight_scale", "weight_probe"):
            setattr(layer, buffer, state[f"{name}.{buffer}"].to(device))
