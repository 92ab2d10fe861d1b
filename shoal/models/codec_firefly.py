"""The Fish Speech 1.5 codec ("Firefly GAN VQ"): log-mel ConvNeXt encoder, grouped FSQ, HiFi-GAN.

Public surface, the same as `models/codec.py`'s modded DAC (so the engine, the vocoder and
`shoal synth` take either): `load_firefly_codec(path, device, dtype) -> FireflyCodec` with
`encode`, `decode`, `frame_length`, `sample_rate`, `num_codebooks` and `stream_pool(...)`
(`codec_stream.CodecStreamPool`, each causal conv's context carried between steps). 1.5 ships it as
`firefly-gan-vq-fsq-8x1024-21hz-generator.pth`; research/model.md section 8 has the architecture.

- Encoder: 44.1 kHz audio -> 160-bin log-mel (n_fft 2048, hop 512, Slaney filterbank) -> causal
  ConvNeXt stages (128, 256, 384, 512 channels) -> two stride-2 causal convs -> 8 groups of a
  4-level finite scalar quantizer ([8, 5, 5, 5]: 1,000 codes) -> 8 codebooks at 21.5 Hz.
- Decoder: the groups' codes -> their latents -> two stride-2 transposed convs with ConvNeXt
  blocks -> HiFi-GAN (five transposed convs 8, 8, 2, 2, 2; each followed by the mean of three
  dilated residual stacks, kernels 3 / 7 / 11) -> tanh. Every conv is causal (left padding only).

Module names follow the reference's, so the shipped state dict loads strictly; the decoder's
convolutions store weight norm (either form; folded once at load, `codec.fold_state_dict`).
The quantizer reproduces the reference library's arithmetic (vector_quantize_pytorch 1.14.24's
`GroupedResidualFSQ` with one quantizer per group), including its double squashing and its
straight-through rounding, so that encoded codes equal the reference's.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shoal.models.codec_base import AudioTooShortError, fold_state_dict, random_weights, read_codec_state_dict
from shoal.models.codec_modules import CausalConv1d, CausalConvTranspose1d, ConvNeXtBlock, StepContext
from shoal.models.codec_stream import CodecStreamPool

FIREFLY_FILE = "firefly-gan-vq-fsq-8x1024-21hz-generator.pth"


FSQ_EPS = 1e-3  # the reference library's `bound` widens each level range by this much


@dataclass
class FireflyConfig:
    """The shipped codec's constructor parameters (fish-speech 1.5 `firefly_gan_vq.yaml`)."""

    sample_rate: int = 44100
    n_fft: int = 2048
    win_length: int = 2048
    hop_length: int = 512
    n_mels: int = 160
    encoder_depths: list[int] = field(default_factory=lambda: [3, 3, 9, 3])
    encoder_dims: list[int] = field(default_factory=lambda: [128, 256, 384, 512])
    encoder_kernel_size: int = 7
    fsq_groups: int = 8
    fsq_levels: list[int] = field(default_factory=lambda: [8, 5, 5, 5])
    downsample_factor: list[int] = field(default_factory=lambda: [2, 2])
    upsample_rates: list[int] = field(default_factory=lambda: [8, 8, 2, 2, 2])
    upsample_kernel_sizes: list[int] = field(default_factory=lambda: [16, 16, 4, 4, 4])
    resblock_kernel_sizes: list[int] = field(default_factory=lambda: [3, 7, 11])
    resblock_dilation_sizes: list[list[int]] = field(default_factory=lambda: [[1, 3, 5]] * 3)
    decoder_channels: int = 512  # the reference's `upsample_initial_channel`
    pre_conv_kernel_size: int = 13
    post_conv_kernel_size: int = 13

    def __post_init__(self) -> None:
        if math.prod(self.upsample_rates) != self.hop_length:
            raise ValueError(
                f"upsample_rates {self.upsample_rates} must multiply to hop_length {self.hop_length}"
            )
        if self.latent_dim % self.fsq_groups:
            raise ValueError(f"{self.latent_dim} latent channels do not split into {self.fsq_groups} groups")
        if any(len(d) != 3 for d in self.resblock_dilation_sizes):
            raise ValueError("each residual stack has exactly three dilations")

    @classmethod
    def from_dict(cls, values: dict) -> FireflyConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def latent_dim(self) -> int:
        return self.encoder_dims[-1]

    @property
    def codebook_size(self) -> int:
        """Codes per group: the product of the levels (1,000 shipped)."""
        return math.prod(self.fsq_levels)

    @property
    def frame_length(self) -> int:
        return self.hop_length * math.prod(self.downsample_factor)


def slaney_mel_filterbank(n_freqs: int, n_mels: int, sample_rate: int) -> Tensor:
    """[n_freqs, n_mels] triangular filters on the Slaney mel scale, Slaney-normalized (area 1),
    from 0 Hz to Nyquist, in float32: the filterbank the reference's LogMelSpectrogram builds
    (torchaudio `melscale_fbanks(norm="slaney", mel_scale="slaney")`)."""
    min_log_hz, min_log_mel, log_step = 1000.0, 15.0, math.log(6.4) / 27.0

    linear_step = 200.0 / 3  # Hz per mel below 1 kHz; the expressions below round as torchaudio's

    def to_mel(hz: float) -> float:
        return hz / linear_step if hz < min_log_hz else min_log_mel + math.log(hz / min_log_hz) / log_step

    def to_hz(mels: Tensor) -> Tensor:
        linear = linear_step * mels
        logarithmic = min_log_hz * torch.exp(log_step * (mels - min_log_mel))
        return torch.where(mels >= min_log_mel, logarithmic, linear)

    bins = torch.linspace(0, sample_rate // 2, n_freqs)
    edges = to_hz(torch.linspace(to_mel(0.0), to_mel(float(sample_rate // 2)), n_mels + 2))
    widths = edges[1:] - edges[:-1]
    distance = edges.unsqueeze(0) - bins.unsqueeze(1)  # [n_freqs, n_mels + 2]
    rising = -distance[:, :-2] / widths[:-1]
    falling = distance[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return filters * (2.0 / (edges[2 : n_mels + 2] - edges[:n_mels])).unsqueeze(0)


class LogMel(nn.Module):
    """Audio [B, T] -> log-mel [B, n_mels, T // hop]: reflect-padded magnitude STFT (not
    centred), Slaney mel filters, log of values clamped at 1e-5."""

    def __init__(self, config: FireflyConfig):
        super().__init__()
        self.config = config
        self.n_fft, self.win_length, self.hop = config.n_fft, config.win_length, config.hop_length
        self.build_buffers()

    def build_buffers(self) -> None:
        """The window and filterbank (non-persistent: computed, never loaded), on the default
        device; again after the module was built on the meta device."""
        config = self.config
        self.register_buffer("window", torch.hann_window(config.win_length), persistent=False)
        filters = slaney_mel_filterbank(config.n_fft // 2 + 1, config.n_mels, config.sample_rate)
        self.register_buffer("filters", filters, persistent=False)

    def forward(self, audio: Tensor) -> Tensor:
        pad = self.win_length - self.hop
        audio = F.pad(audio.unsqueeze(1), (pad // 2, (pad + 1) // 2), mode="reflect").squeeze(1)
        spectrum = torch.stft(
            audio, self.n_fft, hop_length=self.hop, win_length=self.win_length, window=self.window,
            center=False, normalized=False, onesided=True, return_complex=True,
        )  # fmt: skip
        magnitude = torch.sqrt(torch.view_as_real(spectrum).pow(2).sum(-1) + 1e-6)
        mel = torch.matmul(magnitude.transpose(-1, -2), self.filters).transpose(-1, -2)
        return torch.log(torch.clamp(mel, min=1e-5))


class ChannelsFirstLayerNorm(nn.Module):
    """LayerNorm over the channels of [B, C, T], computed as the reference writes it out."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        centred = x - x.mean(1, keepdim=True)
        normed = centred / torch.sqrt(centred.pow(2).mean(1, keepdim=True) + self.eps)
        return self.weight[:, None] * normed + self.bias[:, None]


class ConvNeXtEncoder(nn.Module):
    """log-mel [B, n_mels, T] -> features [B, latent_dim, T]: a causal k7 stem, then ConvNeXt
    stages joined by LayerNorm + 1x1 convs, then a LayerNorm."""

    def __init__(self, config: FireflyConfig):
        super().__init__()
        dims, kernel = config.encoder_dims, config.encoder_kernel_size
        stem = nn.Sequential(
            CausalConv1d(config.n_mels, dims[0], 7, weight_norm=None), ChannelsFirstLayerNorm(dims[0])
        )
        joins = [
            nn.Sequential(ChannelsFirstLayerNorm(a), nn.Conv1d(a, b, 1)) for a, b in itertools.pairwise(dims)
        ]
        self.downsample_layers = nn.ModuleList([stem, *joins])
        self.stages = nn.ModuleList(
            nn.Sequential(*(ConvNeXtBlock(dim, kernel_size=kernel) for _ in range(depth)))
            for dim, depth in zip(dims, config.encoder_depths, strict=True)
        )
        self.norm = ChannelsFirstLayerNorm(dims[-1])

    def forward(self, x: Tensor) -> Tensor:
        for join, stage in zip(self.downsample_layers, self.stages, strict=True):
            x = stage(join(x))
        return self.norm(x)


class FiniteScalarGroup(nn.Module):
    """One group's quantizer: Linear to one value per level, squash, round; indices mix the levels
    in mixed radix (first level fastest). Arithmetic as vector_quantize_pytorch 1.14.24's
    `ResidualFSQ` with one quantizer: it squashes twice (once before the residual loop, once in
    `FSQ.quantize`) and rounds straight-through (z + (round(z) - z)) before the index's
    truncating cast, and so does this."""

    def __init__(self, dim: int, levels: list[int]):
        super().__init__()
        self.project_in = nn.Linear(dim, len(levels))
        self.project_out = nn.Linear(len(levels), dim)
        self.level_counts = list(levels)
        self.build_buffers()

    def build_buffers(self) -> None:
        """The levels and their mixed-radix basis (non-persistent), on the default device; again
        after the module was built on the meta device."""
        levels = self.level_counts
        basis = torch.cumprod(torch.tensor([1, *levels[:-1]]), dim=0, dtype=torch.int32)
        self.register_buffer("levels", torch.tensor(levels, dtype=torch.int32), persistent=False)
        self.register_buffer("basis", basis, persistent=False)

    def _squash(self, z: Tensor) -> Tensor:
        half_range = (self.levels - 1) * (1 + FSQ_EPS) / 2
        offset = torch.where(self.levels % 2 == 0, 0.5, 0.0)
        shift = (offset / half_range).atanh()
        return (z + shift).tanh() * half_range - offset

    def indices(self, x: Tensor) -> Tensor:
        """[..., dim] -> int32 [...] code indices."""
        z = self._squash(self._squash(self.project_in(x)))
        rounded = z + (z.round() - z)
        half_width = self.levels // 2
        normalized = rounded / half_width
        return (((normalized * half_width) + half_width) * self.basis).sum(dim=-1).to(torch.int32)

    def latents(self, indices: Tensor) -> Tensor:
        """int [...] code indices -> [..., dim] (indices past the codebook wrap, as the reference's)."""
        levels = (indices.long().unsqueeze(-1) // self.basis) % self.levels
        half_width = self.levels // 2
        return self.project_out(((levels - half_width) / half_width).to(self.project_out.weight.dtype))


class GroupedFiniteScalarQuantizer(nn.Module):
    """The latent channels split into groups, each quantized on its own (`FiniteScalarGroup`)."""

    def __init__(self, dim: int, groups: int, levels: list[int]):
        super().__init__()
        self.rvqs = nn.ModuleList(FiniteScalarGroup(dim // groups, levels) for _ in range(groups))

    def indices(self, x: Tensor) -> Tensor:
        """[B, T, dim] -> int32 [B, groups, T]."""
        chunks = x.chunk(len(self.rvqs), dim=-1)
        return torch.stack([group.indices(c) for group, c in zip(self.rvqs, chunks, strict=True)], dim=1)

    def latents(self, indices: Tensor) -> Tensor:
        """[B, groups, T] -> [B, T, dim]."""
        return torch.cat([group.latents(indices[:, g]) for g, group in enumerate(self.rvqs)], dim=-1)


class DownsampleQuantizer(nn.Module):
    """Features at the mel rate <-> codes at the frame rate: stride-f causal convs (+ ConvNeXt)
    down before the grouped FSQ, stride-f causal transposed convs (+ ConvNeXt) up after it."""

    def __init__(self, config: FireflyConfig):
        super().__init__()
        dim = config.latent_dim
        self.residual_fsq = GroupedFiniteScalarQuantizer(dim, config.fsq_groups, config.fsq_levels)
        factors = config.downsample_factor
        self.downsample = nn.Sequential(
            *(
                nn.Sequential(CausalConv1d(dim, dim, f, stride=f, weight_norm=None), ConvNeXtBlock(dim))
                for f in factors
            )
        )
        self.upsample = nn.Sequential(
            *(
                nn.Sequential(
                    CausalConvTranspose1d(dim, dim, f, stride=f, weight_norm=None), ConvNeXtBlock(dim)
                )
                for f in reversed(factors)
            )
        )

    def encode(self, features: Tensor) -> Tensor:
        """[B, dim, T_mel] -> int32 codes [B, groups, ceil(T_mel / prod(factors))]."""
        return self.residual_fsq.indices(self.downsample(features).mT)

    def decode(self, codes: Tensor) -> Tensor:
        """[B, groups, T] -> [B, dim, T * prod(factors)]."""
        return self.upsample(self.residual_fsq.latents(codes).mT)


class ResidualStack(nn.Module):
    """Three (SiLU, dilated causal conv, SiLU, dilated causal conv) + skip units, one kernel size."""

    def __init__(self, channels: int, kernel_size: int, dilations: list[int]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            CausalConv1d(channels, channels, kernel_size, dilation=d) for d in dilations
        )
        self.convs2 = nn.ModuleList(
            CausalConv1d(channels, channels, kernel_size, dilation=d) for d in dilations
        )

    def forward(self, x: Tensor) -> Tensor:
        for first, second in zip(self.convs1, self.convs2, strict=True):
            x = second(F.silu(first(F.silu(x)))) + x
        return x


class MultiKernelStack(nn.Module):
    """The mean of residual stacks of different kernel sizes (HiFi-GAN's multi-receptive field)."""

    def __init__(self, channels: int, kernel_sizes: list[int], dilations: list[list[int]]):
        super().__init__()
        self.blocks = nn.ModuleList(
            ResidualStack(channels, k, d) for k, d in zip(kernel_sizes, dilations, strict=True)
        )

    def forward(self, x: Tensor) -> Tensor:
        return torch.stack([block(x) for block in self.blocks], dim=0).mean(dim=0)


class HiFiGANDecoder(nn.Module):
    """latents [B, latent_dim, T_mel] -> audio [B, 1, T_mel * hop] in [-1, 1]."""

    def __init__(self, config: FireflyConfig):
        super().__init__()
        channels = config.decoder_channels
        self.conv_pre = CausalConv1d(config.latent_dim, channels, config.pre_conv_kernel_size)
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i, (rate, kernel) in enumerate(
            zip(config.upsample_rates, config.upsample_kernel_sizes, strict=True)
        ):
            cin, cout = channels // 2**i, channels // 2 ** (i + 1)
            self.ups.append(CausalConvTranspose1d(cin, cout, kernel, stride=rate))
            self.resblocks.append(
                MultiKernelStack(cout, config.resblock_kernel_sizes, config.resblock_dilation_sizes)
            )
        self.conv_post = CausalConv1d(cout, 1, config.post_conv_kernel_size)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_pre(x)
        for up, stack in zip(self.ups, self.resblocks, strict=True):
            x = stack(up(F.silu(x)))
        return torch.tanh(self.conv_post(F.silu(x)))


class FireflyCodec(nn.Module):
    """The whole codec: `encode(audio) -> codes`, `decode(codes) -> audio`; 44.1 kHz mono."""

    def __init__(self, config: FireflyConfig | None = None):
        super().__init__()
        self.config = config or FireflyConfig()
        self.spec_transform = LogMel(self.config)
        self.backbone = ConvNeXtEncoder(self.config)
        self.quantizer = DownsampleQuantizer(self.config)
        self.head = HiFiGANDecoder(self.config)

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    @property
    def frame_length(self) -> int:
        return self.config.frame_length

    @property
    def num_codebooks(self) -> int:
        return self.config.fsq_groups

    @property
    def dtype(self) -> torch.dtype:
        return self.head.conv_pre.conv.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.head.conv_pre.conv.weight.device

    @torch.inference_mode()
    def encode(self, audio: Tensor) -> Tensor:
        """audio [T], [B, T] or [B, 1, T] at `sample_rate` -> codes long [B, num_codebooks,
        ceil((T // hop) / prod(downsample_factor))]: the reference's `encode` of whole clips
        (its mask is all ones then). The mel frames are T // hop, so a clip needs at least one
        hop of samples, and more than (win_length - hop) / 2 for the reflect padding."""
        audio = audio.reshape(-1, audio.shape[-1])
        pad = (self.config.win_length - self.config.hop_length) // 2
        shortest = max(self.config.hop_length, pad + 1)
        if audio.shape[-1] < shortest:
            raise AudioTooShortError(
                f"audio of {audio.shape[-1]} samples is too short to encode "
                f"(at least {shortest} at {self.sample_rate} Hz)"
            )
        mels = self.spec_transform(audio.to(self.device).float()).to(self.dtype)
        return self.quantizer.encode(self.backbone(mels)).long()

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, num_codebooks, frames] or [num_codebooks, frames] -> audio [B, 1, samples]."""
        codes = codes[None] if codes.dim() == 2 else codes
        return self.head(self.quantizer.decode(codes.long().to(self.device)))

    def stream_pool(self, max_streams: int):
        """A pool of streaming-decode states (`codec_stream.CodecStreamPool`, CUDA graphs
        included), over `stream_state_shapes` and `decode_step` below."""
        return CodecStreamPool(self, max_streams)

    def stream_state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-stream carried state (no batch dim), keyed by the module that owns it: each causal
        conv of the decode path keeps its last (kernel - 1) * dilation inputs (a transposed conv,
        its last ceil(kernel / stride) - 1), time-major. The decode path has no attention, so
        that is all it needs to continue exactly where it stopped."""
        shapes = {}
        for name, module in self.named_modules():
            on_decode_path = name.startswith(("quantizer.upsample", "head."))
            if on_decode_path and isinstance(module, CausalConv1d | CausalConvTranspose1d) and module.context:
                shapes[name] = (module.context, module.conv.in_channels)
        return shapes

    def decode_step(
        self, codes: Tensor, valid: Tensor, positions: Tensor, states: dict[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Decode new frames codes [B, N, t] (row b real for its first valid[b] frames) ->
        (audio [B, t * frame_length], new states), carrying each conv's context in `states`
        (`codec_modules.StepContext`); time-major ([B, T, C]) throughout. `positions` (each
        row's first new frame) is unused: no layer depends on absolute time."""
        ctx = StepContext(states, positions)
        x = self.quantizer.residual_fsq.latents(codes)
        for i, (up, convnext) in enumerate(self.quantizer.upsample):
            x = up.step(x, ctx, f"quantizer.upsample.{i}.0", valid)
            valid = valid * up.stride
            x = convnext.step(x, ctx, f"quantizer.upsample.{i}.1", valid)
        head = self.head
        x = head.conv_pre.step(x, ctx, "head.conv_pre", valid)
        for i, (up, stack) in enumerate(zip(head.ups, head.resblocks, strict=True)):
            x = up.step(F.silu(x), ctx, f"head.ups.{i}", valid)
            valid = valid * up.stride
            outputs = []
            for j, block in enumerate(stack.blocks):
                key, y = f"head.resblocks.{i}.blocks.{j}", x
                for k, (first, second) in enumerate(zip(block.convs1, block.convs2, strict=True)):
                    h = first.step(F.silu(y), ctx, f"{key}.convs1.{k}", valid)
                    y = second.step(F.silu(h), ctx, f"{key}.convs2.{k}", valid) + y
                outputs.append(y)
            x = torch.stack(outputs, dim=0).mean(dim=0)
        audio = head.conv_post.step(F.silu(x), ctx, "head.conv_post", valid)
        return torch.tanh(audio.squeeze(-1)), ctx.new_states


def is_firefly_state_dict(state: dict[str, Tensor]) -> bool:
    """Whether a codec state dict is Firefly's (a HiFi-GAN `head`), not the modded DAC's."""
    return any(key.startswith("head.conv_pre.") for key in state)


def find_firefly_config(path: Path) -> FireflyConfig:
    """`codec_config.json` beside the file when it is a Firefly config, else the shipped one."""
    candidate = path.parent / "codec_config.json"
    if candidate.is_file():
        values = json.loads(candidate.read_text())
        if "fsq_levels" in values:
            return FireflyConfig.from_dict(values)
    return FireflyConfig()


def random_firefly_codec(
    config: FireflyConfig | None = None, seed: int = 0, device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> FireflyCodec:  # fmt: skip
    """A random-weight codec in memory, as `save_random_firefly_codec` + `load_firefly_codec` give."""
    config = config or FireflyConfig()
    with torch.device("meta"):
        codec = FireflyCodec(config)
    return load_firefly_codec(Path("random"), device, dtype, config=config, state=random_weights(codec, seed))


def save_random_firefly_codec(
    path: str | Path, config: FireflyConfig | dict | None = None, seed: int = 0
) -> Path:
    """Write a random-weight Firefly generator (official format: the weight-normed convs as
    parametrizations) plus `codec_config.json` beside it; `path` may be the checkpoint directory."""
    config = FireflyConfig.from_dict(config) if isinstance(config, dict) else (config or FireflyConfig())
    path = Path(path)
    path = path / FIREFLY_FILE if path.is_dir() else path
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        codec = FireflyCodec(config)
    torch.save(random_weights(codec, seed), path)
    (path.parent / "codec_config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return path


def load_firefly_codec(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    config: FireflyConfig | dict | None = None, state: dict[str, Tensor] | None = None,
) -> FireflyCodec:  # fmt: skip
    """Build the codec (`config`, else `codec_config.json` beside the file, else the shipped
    config) and load the generator file as shipped: plain or {"state_dict": ...}, with or without
    `generator.`, weight norm as parametrizations, weight_g/v or folded. Strict: any missing,
    unexpected or mis-shaped tensor is an error naming it."""
    path = Path(path)
    path = path / FIREFLY_FILE if path.is_dir() else path
    if isinstance(config, dict):
        config = FireflyConfig.from_dict(config)
    config = config or find_firefly_config(path)
    with torch.device("meta"):
        codec = FireflyCodec(config)
    state = read_codec_state_dict(path) if state is None else state
    codec.load_state_dict(fold_state_dict(codec, state), assign=True)
    for module in codec.modules():  # buffers built on the meta device: build them again
        if isinstance(module, LogMel | FiniteScalarGroup):
            module.build_buffers()
    codec = codec.to(device=device, dtype=dtype)
    codec.spec_transform.float()  # the mel runs in fp32 whatever the codec's dtype
    return codec.eval().requires_grad_(False)
