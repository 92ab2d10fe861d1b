"""Building blocks of the "modded DAC" codec (S1-mini / S2), plain PyTorch.

Every module reproduces the reference arithmetic (fish_speech/models/dac/modded_dac.py, rvq.py)
and keeps the reference's parameter names, so the official state dict maps onto it one to one.
Weight norm is folded at load time, so convolutions hold a plain `weight`; `weight_norm` says
how the official file stores it ("parametrizations" or "legacy" weight_g/weight_v, or None).

Decode-path modules also have `step(x, ctx, valid)`: the streaming form. `ctx` (a `StepContext`)
holds the batched carried state; `valid` [B] is how many leading time steps of `x` are real
per row (rows are right-padded to a common length). Causality makes the padding harmless to the
real steps; the carried state is taken at each row's own valid end. The streaming form is
time-major: x is `[B, T, C]`, so every convolution runs channels-last (cuDNN's NHWC tensor-core
kernels, no layout transposes) and the transformer and ConvNeXt need no transposes at all.
Convolution biases are deferred into the next fused Snake (`Pending`), saving a pass each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shoal.kernels.snake import snake
from shoal.tuning import TUNING


@dataclass
class TransformerConfig:
    """`ModelArgs` of the reference: the fields that change the arithmetic."""

    n_layer: int = 8
    n_head: int = 16
    dim: int = 1024
    intermediate_size: int = 3072
    head_dim: int = 64
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    n_local_heads: int = -1

    @classmethod
    def from_dict(cls, values: dict) -> TransformerConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


@dataclass
class CodecConfig:
    """Constructor parameters of the official `modded_dac_vq` codec; defaults are the shipped ones."""

    sample_rate: int = 44100
    encoder_dim: int = 64
    encoder_rates: list[int] = field(default_factory=lambda: [2, 4, 8, 8])
    decoder_dim: int = 1536
    decoder_rates: list[int] = field(default_factory=lambda: [8, 8, 4, 2])
    encoder_transformer_layers: list[int] = field(default_factory=lambda: [0, 0, 0, 4])
    # Present in the official yaml but unused: the reference builds and then drops these modules.
    decoder_transformer_layers: list[int] = field(default_factory=lambda: [4, 0, 0, 0])
    latent_dim: int = 1024
    general: TransformerConfig = field(default_factory=TransformerConfig)
    n_codebooks: int = 9
    codebook_size: int = 1024
    codebook_dim: int = 8
    downsample_factor: list[int] = field(default_factory=lambda: [2, 2])
    semantic_codebook_size: int = 4096
    window_size: int = 128
    encoder_window_size: int = 512  # hard-coded in the reference EncoderBlock
    transformer: TransformerConfig = field(default_factory=TransformerConfig)

    @classmethod
    def from_dict(cls, values: dict) -> CodecConfig:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in known}
        for name in ("general", "transformer"):
            if isinstance(kwargs.get(name), dict):
                kwargs[name] = TransformerConfig.from_dict(kwargs[name])
        return cls(**kwargs)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("general", "transformer"):
            out[name] = dict(vars(out[name]))
        return out

    @property
    def hop_length(self) -> int:
        return math.prod(self.encoder_rates)

    @property
    def frame_length(self) -> int:
        return self.hop_length * math.prod(self.downsample_factor)


class StepContext:
    """Carried state for one batched streaming step: `states[key]` in, `new_states[key]` out."""

    def __init__(self, states: dict[str, Tensor], positions: Tensor):
        self.states = states
        self.new_states: dict[str, Tensor] = {}
        self.positions = positions  # [B] absolute frame index of each row's first new frame

    def extend(self, key: str, x: Tensor, valid: Tensor, dim: int = -1, joined: bool = False) -> Tensor:
        """Prepend the carried last samples of this row's stream along `dim`; save the new ones.
        `joined`: x already starts with them (a filled `StepContext.joined` buffer)."""
        carried = self.states[key]
        if joined:
            self.new_states[key] = take_window(x, valid, carried.shape[dim], dim)
            return x
        x, self.new_states[key] = append_window(carried, x, valid, dim)
        return x

    def joined(self, key: str, new: int, align: int = 1) -> Tensor:
        """A time-major buffer [B, context + new, C]: the carried rows, then `new` rows for the
        caller to write (what `extend` would return, without copying the new rows into it);
        `extend(..., dim=1, joined=True)` saves the state once they are written. With `align`,
        a view of a buffer whose rows are rounded up to a multiple of it (the rows past the view
        are unwritten: room for `CausalConv1d`'s phase split without a padding copy)."""
        carried = self.states[key]
        batch, context, channels = carried.shape
        rows = context + new
        buffer = carried.new_empty(batch, -(-rows // align) * align, channels)
        buffer[:, :context] = carried
        return buffer[:, :rows]


def chosen_for(setting: bool | None, device: torch.device) -> bool:
    """A codec `Tuning` switch on `device`: None means on CUDA only."""
    return device.type == "cuda" if setting is None else setting


def append_window(carried: Tensor, x: Tensor, valid: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """(carried then x along `dim`, the state to carry next: the last carried-length entries up to
    each row's valid end). `StepContext.extend` as a pure function, for compiled code."""
    joined = torch.cat([carried, x], dim=dim)
    return joined, take_window(joined, valid, carried.shape[dim], dim)


def take_window(x: Tensor, start: Tensor, length: int, dim: int = -1) -> Tensor:
    """x[b, ..., start[b] : start[b] + length, ...] along `dim`, per row, without host sync."""
    dim = dim % x.dim()
    shape = [1] * x.dim()
    shape[dim] = length
    index = torch.arange(length, device=x.device).view(shape) + start.view(-1, *([1] * (x.dim() - 1)))
    size = list(x.shape)
    size[dim] = length
    return torch.gather(x, dim, index.expand(size))


# A conv output whose bias is still to be added (by the next fused Snake): (tensor or None, bias or None).
Pending = tuple[Tensor | None, Tensor | None]
NO_PENDING: Pending = (None, None)


class Snake1d(nn.Module):
    """x + sin^2(alpha x) / alpha, per channel; optionally adds a pending residual first."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Returns (x + residual, snake(x + residual)); the sum is the next skip connection."""
        return snake(x, self.alpha, residual)

    def step(
        self, x: Tensor, pending: Pending = NO_PENDING, need_sum: bool = True, out: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Time-major x [B, T, C]: (s, snake(s)) with s = x + pending tensor + pending bias;
        the activation written into `out` if given."""
        return snake(x, self.alpha, pending[0], pending[1], channels_last=True, need_sum=need_sum, out=out)


def snake_then_conv(
    snake_module: Snake1d, conv, x: Tensor, pending: Pending, ctx: StepContext, key: str, valid: Tensor,
    bias: bool = True, need_sum: bool = True,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(s, conv(snake(s))) in the streaming step, s = x + pending. A conv with carried context
    reads [carried | snake(s)]: the Snake writes its output straight after the carried rows
    (`StepContext.joined`) instead of `extend` concatenating them, which saves a read and a write
    of the activation per conv (the decoder's widest tensors)."""
    if not conv.context:
        total, h = snake_module.step(x, pending, need_sum=need_sum)
        return total, conv.step(h, ctx, key, valid, bias=bias)
    joined = ctx.joined(key, x.shape[1], align=conv.row_alignment(x.device))
    total, _ = snake_module.step(x, pending, need_sum=need_sum, out=joined[:, conv.context :])
    return total, conv.step(joined, ctx, key, valid, bias=bias, joined=True)


def channels_last_2d(x: Tensor) -> Tensor:
    """Time-major x [B, T, C] as a 2-D conv input [B, C, 1, T] in channels-last memory, no copy.

    F.conv1d would not do: it makes 3-D inputs contiguous (channels first) before widening them
    to 2-D, so cuDNN would run NCHW with a transpose before and after every conv."""
    return x.transpose(1, 2).unsqueeze(2)


class CausalConv1d(nn.Module):
    """Conv1d padded on the left only (`CausalConvNet`); weight-norm folded at load."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 groups: int = 1, weight_norm: str | None = "parametrizations"):  # fmt: skip
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel_size, stride=stride, dilation=dilation, groups=groups)
        self.conv.weight_norm = weight_norm
        self.stride = stride
        self.receptive = (kernel_size - 1) * dilation + 1
        self.context = self.receptive - stride  # left padding == carried samples when streaming
        # Streaming: run the dilation as phases of an undilated conv (`_phase_split`); None:
        # on CUDA only.
        self.phase_split: bool | None = TUNING.codec_phase_split_dilations

    def splits_phases(self, device: torch.device) -> bool:
        """Whether the streaming step on `device` runs this conv as phases."""
        return chosen_for(self.phase_split, device) and self.phase_alignment_possible

    @property
    def phase_alignment_possible(self) -> bool:
        """Whether the streaming step could run this conv as phases (a dilated dense conv)."""
        conv = self.conv
        return conv.dilation[0] > 1 and conv.groups == 1 and conv.stride[0] == 1

    def row_alignment(self, device: torch.device) -> int:
        """Rows the streaming input on `device` is best allocated in multiples of (no padding copy)."""
        return self.conv.dilation[0] if self.splits_phases(device) else 1

    def forward(self, x: Tensor) -> Tensor:
        length = x.shape[-1]
        frames = math.ceil((length - self.receptive + self.context) / self.stride + 1)
        extra = (frames - 1) * self.stride + self.receptive - self.context - length
        return self.conv(F.pad(x, (self.context, extra)))

    def step(
        self, x: Tensor, ctx: StepContext, key: str, valid: Tensor, bias: bool = True, joined: bool = False
    ) -> Tensor:
        """Time-major x [B, T, C] -> [B, T, C_out]; without `bias` the caller adds conv.bias.
        `joined`: x already starts with the carried context (`StepContext.joined`)."""
        assert self.stride == 1, "streaming is only defined for the stride-1 decode-path convs"
        if self.context > 0:
            x = ctx.extend(key, x, valid, dim=1, joined=joined)
        conv = self.conv
        if conv.groups > 1:  # depthwise (ConvNeXt): see `_depthwise`
            return self._depthwise(x, bias)
        if self.splits_phases(x.device):
            return self._phase_split(x, bias)
        weight, bias_ = conv.weight.unsqueeze(2), conv.bias if bias else None
        y = F.conv2d(channels_last_2d(x), weight, bias_, 1, 0, (1, *conv.dilation), conv.groups)
        return y.squeeze(2).transpose(1, 2)

    def _phase_split(self, x: Tensor, bias: bool) -> Tensor:
        """The dilation-d conv of time-major x [B, rows, C] (context included) as an undilated
        (k x 1) conv over x's rows viewed as [B, C, rows / d, d]: output row h * d + p reads
        rows (h + j) * d + p, j < k, exactly the dilated taps. cuDNN's dilated kernels took
        1.25-2.1x the time of undilated ones of the same shape (docs/codec.md). x is padded to
        a multiple of d only when it is not a view with room for that (`StepContext.joined`)."""
        conv = self.conv
        dilation, kernel = conv.dilation[0], conv.kernel_size[0]
        batch, rows, channels = x.shape
        padded = -(-rows // dilation) * dilation
        rows_packed = x.stride(1) == channels and x.stride(2) == 1 and x.stride(0) >= padded * channels
        reach = x.storage_offset() + (batch - 1) * x.stride(0) + padded * channels
        if not rows_packed or reach * x.element_size() > x.untyped_storage().nbytes():
            x = F.pad(x, (0, 0, 0, padded - rows))
        phases = x.as_strided(
            (batch, channels, padded // dilation, dilation), (x.stride(0), 1, dilation * channels, channels)
        )
        y = F.conv2d(phases, conv.weight.unsqueeze(3), conv.bias if bias else None)
        out = y.permute(0, 2, 3, 1).reshape(batch, -1, y.shape[1])  # [B, (rows/d - k + 1) * d, C_out]
        return out[:, : rows - (kernel - 1) * dilation]

    def _depthwise(self, x: Tensor, bias: bool) -> Tensor:
        """Depthwise conv of time-major x (context included) as K shifted products summed in fp32.

        Not cuDNN: for this channels-last depthwise shape its heuristic (no algorithm search)
        picks a direct kernel that took 0.41 s of a 0.45 s eager step on an H200. The data is
        small (1024 channels at 43/86 Hz), so a plain unfold is cheap."""
        conv = self.conv
        windows = x.unfold(1, self.receptive, 1)[..., :: conv.dilation[0]]  # [B, T, C, K]
        y = (windows.float() * conv.weight[:, 0].float()).sum(-1)
        if bias and conv.bias is not None:
            y = y + conv.bias.float()
        return y.to(x.dtype)


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d with the last kernel-stride outputs trimmed (`CausalTransConvNet`)."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int,
                 weight_norm: str | None = "parametrizations"):  # fmt: skip
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel_size, stride=stride)
        self.conv.weight_norm = weight_norm
        self.stride = stride
        self.trim = kernel_size - stride
        self.context = math.ceil(kernel_size / stride) - 1  # earlier inputs reaching a new output

    def row_alignment(self, device: torch.device) -> int:
        """Streaming inputs need no rounding (see `CausalConv1d.row_alignment`)."""
        return 1

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x)
        return y[..., : y.shape[-1] - self.trim]

    def step(
        self, x: Tensor, ctx: StepContext, key: str, valid: Tensor, bias: bool = True, joined: bool = False
    ) -> Tensor:
        """Time-major x [B, t, C] -> [B, t * stride, C_out] (a view into the conv's output).
        `joined`: x already starts with the carried context (`StepContext.joined`)."""
        new = x.shape[1] - (self.context if joined else 0)
        if self.context > 0:
            x = ctx.extend(key, x, valid, dim=1, joined=joined)
        conv = self.conv
        y = F.conv_transpose2d(
            channels_last_2d(x), conv.weight.unsqueeze(2), conv.bias if bias else None, (1, *conv.stride)
        )
        start = self.context * self.stride
        return y.squeeze(2).transpose(1, 2)[:, start : start + new * self.stride]


class ResidualUnit(nn.Module):
    """Snake, dilated causal conv k7, Snake, conv k1, plus the skip (added lazily by the caller)."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(dim), CausalConv1d(dim, dim, 7, dilation=dilation), Snake1d(dim),
            CausalConv1d(dim, dim, 1),
        )  # fmt: skip

    def forward(self, x: Tensor, pending: Tensor | None) -> tuple[Tensor, Tensor]:
        """(x, pending) stand for x + pending; returns the same pair after this unit."""
        x, h = self.block[0](x, pending)
        h = self.block[2](self.block[1](h))[1]
        return x, self.block[3](h)

    def step(
        self, x: Tensor, pending: Pending, ctx: StepContext, key: str, valid: Tensor
    ) -> tuple[Tensor, Pending]:
        """Time-major; (x, pending) stand for x + pending, as in `forward`. Biases are fused."""
        conv, pointwise = self.block[1], self.block[3]
        x, h = snake_then_conv(self.block[0], conv, x, pending, ctx, f"{key}.block.1", valid, bias=False)
        h = self.block[2].step(h, (None, conv.conv.bias), need_sum=False)[1]
        return x, (pointwise.step(h, ctx, f"{key}.block.3", valid, bias=False), pointwise.conv.bias)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv (k7 in every shipped codec), LayerNorm, Linear x4, GELU, Linear,
    layer scale, residual."""

    def __init__(self, dim: int, mlp_ratio: float = 4.0, kernel_size: int = 7):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size, groups=dim, weight_norm=None)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, int(mlp_ratio * dim))
        self.pwconv2 = nn.Linear(int(mlp_ratio * dim), dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def _pointwise(self, h: Tensor) -> Tensor:
        """Time-major h [B, T, C] -> gamma * MLP(norm(h)), time-major."""
        return self.gamma * self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))

    def forward(self, x: Tensor) -> Tensor:
        return x + self._pointwise(self.dwconv(x).transpose(1, 2)).transpose(1, 2)

    def step(self, x: Tensor, ctx: StepContext, key: str, valid: Tensor) -> Tensor:
        """Time-major x [B, T, C]."""
        return x + self._pointwise(self.dwconv.step(x, ctx, f"{key}.dwconv", valid))


# ---------------------------------------------------------------- window-limited transformer


def rope_cos_sin(positions: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos/sin for integer positions [...], rounded to bf16 like the reference table, as fp32."""
    inv = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, device=positions.device)[: head_dim // 2].float() / head_dim)
    )
    angles = positions.float().unsqueeze(-1) * inv
    rotation = torch.polar(torch.ones_like(angles), angles)
    return rotation.real.bfloat16().float(), rotation.imag.bfloat16().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, H, D] with interleaved pairs; cos/sin [B or 1, T, D/2]; math in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return out.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 1e-2))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        if cfg.n_local_heads not in (-1, cfg.n_head):
            raise ValueError("the codec transformer is multi-head (n_local_heads == n_head) only")
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.n_head * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.dim, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Returns q, k, v as [B, H, T, D], RoPE applied to q and k."""
        q, k, v = self.wqkv(x).unflatten(-1, (3, self.n_head, self.head_dim)).unbind(2)
        return (
            apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2),
            v.transpose(1, 2),
        )  # fmt: skip

    def out(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention_layer_scale = LayerScale(cfg.dim)
        self.ffn_layer_scale = LayerScale(cfg.dim)

    def finish(self, x: Tensor, attended: Tensor) -> Tensor:
        h = x + self.attention_layer_scale(attended)
        return h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h)))


class WindowLimitedTransformer(nn.Module):
    """Causal transformer where position i attends to positions i-window+1 .. i; channels first."""

    def __init__(self, cfg: TransformerConfig, window_size: int):
        super().__init__()
        self.cfg, self.window = cfg, window_size
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self._compiled = None

    def forward(self, x: Tensor) -> Tensor:
        x = x.transpose(1, 2)
        length = x.shape[1]
        pos = torch.arange(length, device=x.device)
        cos, sin = rope_cos_sin(pos[None], self.cfg.head_dim, self.cfg.rope_base)
        distance = pos[:, None] - pos[None, :]
        mask = (distance >= 0) & (distance < self.window)
        for layer in self.layers:
            q, k, v = layer.attention.qkv(layer.attention_norm(x), cos, sin)
            x = layer.finish(x, layer.attention.out(q, k, v, mask))
        return self.norm(x).transpose(1, 2)

    def step(self, x: Tensor, ctx: StepContext, key: str, valid: Tensor) -> Tensor:
        """New frames x [B, t, C] (time-major in and out); carries each layer's last window-1
        keys/values (post-RoPE)."""
        new, cached = x.shape[1], self.window - 1
        qpos = ctx.positions[:, None] + torch.arange(new, device=x.device)  # [B, t]
        kpos = torch.cat([ctx.positions[:, None] - cached + torch.arange(cached, device=x.device), qpos], 1)
        distance = qpos[:, :, None] - kpos[:, None, :]
        mask = ((distance >= 0) & (distance < self.window) & (kpos[:, None, :] >= 0))[:, None]
        cos, sin = rope_cos_sin(qpos, self.cfg.head_dim, self.cfg.rope_base)
        names = [(f"{key}.layers.{i}.k", f"{key}.layers.{i}.v") for i in range(len(self.layers))]
        carried = [(ctx.states[k_name], ctx.states[v_name]) for k_name, v_name in names]
        x, saved = self._step_layers(x.device)(x, cos, sin, mask, carried, valid)
        for (k_name, v_name), (k, v) in zip(names, saved, strict=True):
            ctx.new_states[k_name], ctx.new_states[v_name] = k, v
        return x

    def _step_layers(self, device: torch.device):
        """The layers' step, compiled by TorchInductor (norms, RoPE, residuals and SiLU fused
        around the GEMMs and attention) when `Tuning.codec_compile_transformer` says so for
        `device` (None: on CUDA)."""
        if not chosen_for(TUNING.codec_compile_transformer, device):
            return self._layers_step
        if self._compiled is None:
            self._compiled = torch.compile(self._layers_step, fullgraph=True)
        return self._compiled

    def _layers_step(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, carried: list[tuple[Tensor, Tensor]],
        valid: Tensor,
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:  # fmt: skip
        saved = []
        for layer, (k_carried, v_carried) in zip(self.layers, carried, strict=True):
            q, k, v = layer.attention.qkv(layer.attention_norm(x), cos, sin)
            k, k_saved = append_window(k_carried, k, valid, 2)
            v, v_saved = append_window(v_carried, v, valid, 2)
            saved.append((k_saved, v_saved))
            x = layer.finish(x, layer.attention.out(q, k, v, mask))
        return self.norm(x), saved

    def state_shapes(self, key: str) -> dict[str, tuple[int, ...]]:
        kv = (self.cfg.n_head, self.window - 1, self.cfg.head_dim)
        return {f"{key}.layers.{i}.{name}": kv for i in range(len(self.layers)) for name in "kv"}
