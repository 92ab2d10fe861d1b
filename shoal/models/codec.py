"""The S1-mini / S2 codec ("modded DAC"): encoder, downsampling RVQ, decoder, and its checkpoint.

Public surface: `load_codec(path, device, dtype) -> Codec` (or, given Fish Speech 1.5's
generator, `codec_firefly.FireflyCodec`) with `encode`, `encode_with_lengths`
(a batch of clips of different lengths), `decode`, `frame_length`, `sample_rate`,
`num_codebooks`, and streaming through `Codec.stream_pool(...)` (see `codec_stream.py` and
docs/codec.md). `save_random_codec` writes a random-weight `codec.pth` in the official on-disk
format.

Module and parameter names follow the reference exactly, so `official_layout(codec)` (names and
shapes as the official file stores them, weight norm unfolded) is what `codec.pth` must contain.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shoal.models.codec_base import (
    RANDOM_WEIGHT_GAIN,
    AudioTooShortError,
    fold_state_dict,
    official_layout,
    random_weights,
    read_codec_state_dict,
    weight_normed,
)
from shoal.models.codec_firefly import FIREFLY_FILE, is_firefly_state_dict, load_firefly_codec
from shoal.models.codec_modules import (
    CausalConv1d,
    CausalConvTranspose1d,
    CodecConfig,
    ConvNeXtBlock,
    ResidualUnit,
    Snake1d,
    TransformerConfig,
    WindowLimitedTransformer,
)
from shoal.models.codec_stream import CodecStreamPool, decode_step, stream_state_shapes
from shoal.models.layers import embedding

# Re-exported: callers import the shared checkpoint helpers and the error from here.
__all__ = [
    "RANDOM_WEIGHT_GAIN", "AudioTooShortError", "Codec", "CodecConfig", "codec_file", "fold_state_dict",
    "load_codec", "official_layout", "random_codec", "random_state_dict", "random_weights",
    "read_codec_state_dict", "save_random_codec", "weight_normed",
]  # fmt: skip


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, stride: int, n_layers: int, general: TransformerConfig, window: int):
        super().__init__()
        blocks: list[nn.Module] = [ResidualUnit(dim // 2, d) for d in (1, 3, 9)]
        blocks += [Snake1d(dim // 2), CausalConv1d(dim // 2, dim, 2 * stride, stride=stride)]
        if n_layers:
            cfg = TransformerConfig(**{**vars(general), "n_layer": n_layers, "n_head": dim // 64, "dim": dim})
            cfg.intermediate_size = dim * 3
            blocks.append(WindowLimitedTransformer(cfg, window))
        self.block = nn.Sequential(*blocks)

    def forward(self, x: Tensor) -> Tensor:
        pending = None
        for unit in self.block[:3]:
            x, pending = unit(x, pending)
        x = self.block[4](self.block[3](x, pending)[1])
        return self.block[5](x) if len(self.block) > 5 else x


class Encoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        dim = cfg.encoder_dim
        blocks: list[nn.Module] = [CausalConv1d(1, dim, 7)]
        for stride, n_layers in zip(cfg.encoder_rates, cfg.encoder_transformer_layers, strict=True):
            dim *= 2
            blocks.append(EncoderBlock(dim, stride, n_layers, cfg.general, cfg.encoder_window_size))
        blocks += [Snake1d(dim), CausalConv1d(dim, cfg.latent_dim, 3)]
        self.block = nn.Sequential(*blocks)

    def forward(self, audio: Tensor) -> Tensor:
        x = self.block[0](audio)
        for block in self.block[1:-2]:
            x = block(x)
        return self.block[-1](self.block[-2](x)[1])


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(cin), CausalConvTranspose1d(cin, cout, 2 * stride, stride),
            *(ResidualUnit(cout, d) for d in (1, 3, 9)),
        )  # fmt: skip


class Decoder(nn.Module):
    """conv k7, 4 x (Snake, transposed conv, 3 residual units), Snake, conv k7 -> 1, tanh."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(cfg.latent_dim, cfg.decoder_dim, 7)]
        for i, stride in enumerate(cfg.decoder_rates):
            layers.append(DecoderBlock(cfg.decoder_dim // 2**i, cfg.decoder_dim // 2 ** (i + 1), stride))
        out_dim = cfg.decoder_dim // 2 ** len(cfg.decoder_rates)
        layers += [Snake1d(out_dim), CausalConv1d(out_dim, 1, 7), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x, pending = self.model[0](x), None
        for block in self.model[1:-3]:
            x = block.block[1](block.block[0](x, pending)[1])
            pending = None
            for unit in block.block[2:]:
                x, pending = unit(x, pending)
        return torch.tanh(self.model[-2](self.model[-3](x, pending)[1]))


class VectorQuantize(nn.Module):
    """One DAC codebook: project to codebook_dim, nearest entry by cosine, project back."""

    def __init__(self, dim: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.in_proj = nn.Conv1d(dim, codebook_dim, 1)
        self.out_proj = nn.Conv1d(codebook_dim, dim, 1)
        self.in_proj.weight_norm = self.out_proj.weight_norm = "legacy"
        self.codebook = embedding(codebook_size, codebook_dim)

    def quantize(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """z [B, D, T] -> (out_proj(quantized) [B, D, T], codes [B, T])."""
        z_e = self.in_proj(z)
        rows = F.normalize(z_e.transpose(1, 2).reshape(-1, z_e.shape[1]))
        book = F.normalize(self.codebook.weight)
        dist = rows.pow(2).sum(1, keepdim=True) - 2 * rows @ book.t() + book.pow(2).sum(1, keepdim=True).t()
        codes = (-dist).max(1)[1].view(z.shape[0], -1)
        z_q = self.embed(codes)
        return self.out_proj(z_e + (z_q - z_e)), codes

    def embed(self, codes: Tensor) -> Tensor:
        return F.embedding(codes, self.codebook.weight).transpose(1, 2)


class ResidualVectorQuantize(nn.Module):
    def __init__(self, dim: int, n_codebooks: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.codebook_size = codebook_size
        self.quantizers = nn.ModuleList(
            VectorQuantize(dim, codebook_size, codebook_dim) for _ in range(n_codebooks)
        )

    def encode(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Returns (sum of quantized parts, codes [B, N, T])."""
        z_q, residual, codes = 0.0, z, []
        for quantizer in self.quantizers:
            part, code = quantizer.quantize(residual)
            z_q, residual = z_q + part, residual - part
            codes.append(code)
        return z_q, torch.stack(codes, 1)

    def decode(self, codes: Tensor) -> Tensor:
        z_q = 0.0
        for i, quantizer in enumerate(self.quantizers):
            z_q = z_q + quantizer.out_proj(quantizer.embed(codes[:, i]))
        return z_q


class DownsampleResidualVectorQuantize(nn.Module):
    """Downsample x4, window transformer, 1 semantic + N residual codebooks; the reverse to decode."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        dim = cfg.latent_dim
        self.semantic_quantizer = ResidualVectorQuantize(dim, 1, cfg.semantic_codebook_size, cfg.codebook_dim)
        self.quantizer = ResidualVectorQuantize(dim, cfg.n_codebooks, cfg.codebook_size, cfg.codebook_dim)
        self.downsample = nn.Sequential(
            *(
                nn.Sequential(CausalConv1d(dim, dim, f, stride=f, weight_norm=None), ConvNeXtBlock(dim))
                for f in cfg.downsample_factor
            )
        )
        self.upsample = nn.Sequential(
            *(
                nn.Sequential(CausalConvTranspose1d(dim, dim, f, f, weight_norm=None), ConvNeXtBlock(dim))
                for f in reversed(cfg.downsample_factor)
            )
        )
        self.pre_module = WindowLimitedTransformer(cfg.transformer, cfg.window_size)
        self.post_module = WindowLimitedTransformer(cfg.transformer, cfg.window_size)

    def encode(self, z: Tensor) -> Tensor:
        z = self.pre_module(self.downsample(z))
        semantic_z, semantic_codes = self.semantic_quantizer.encode(z)
        _, codes = self.quantizer.encode(z - semantic_z)
        return torch.cat([semantic_codes, codes], 1)

    def embed(self, codes: Tensor) -> Tensor:
        """codes [B, 1+N, T] -> latent [B, D, T] at the frame rate (codes clamped like the reference)."""
        semantic = codes[:, :1].clamp(0, self.semantic_quantizer.codebook_size - 1)
        residual = codes[:, 1:].clamp(0, self.quantizer.codebook_size - 1)
        return self.semantic_quantizer.decode(semantic) + self.quantizer.decode(residual)

    def decode(self, codes: Tensor) -> Tensor:
        return self.upsample(self.post_module(self.embed(codes)))


class Codec(nn.Module):
    """The whole codec. `encode(audio) -> codes`, `decode(codes) -> audio`; 44.1 kHz mono."""

    def __init__(self, config: CodecConfig | None = None):
        super().__init__()
        self.config = config or CodecConfig()
        self.encoder = Encoder(self.config)
        self.quantizer = DownsampleResidualVectorQuantize(self.config)
        self.decoder = Decoder(self.config)

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    @property
    def frame_length(self) -> int:
        return self.config.frame_length

    @property
    def num_codebooks(self) -> int:
        return 1 + self.config.n_codebooks

    @torch.inference_mode()
    def encode(self, audio: Tensor, lengths: Tensor | list[int] | None = None) -> Tensor:
        """audio [T], [B, T] or [B, 1, T] at `sample_rate` -> codes long [B, num_codebooks, frames].

        Right-padded with zeros to whole frames: frames = ceil(T / frame_length). `lengths`
        (valid samples per item, for a batch of clips of different lengths right-padded to T):
        see `encode_with_lengths`, which also gives each item's frame count."""
        return self.encode_with_lengths(audio, lengths)[0]

    @torch.inference_mode()
    def encode_with_lengths(
        self, audio: Tensor, lengths: Tensor | list[int] | None = None
    ) -> tuple[Tensor, Tensor]:
        """(codes long [B, num_codebooks, ceil(T / frame_length)], frame_counts long [B] on the
        CPU), as the reference's `encode(audios, audio_lengths)`: frame_counts[b] =
        ceil(lengths[b] / frame_length) (None: every item is T samples long).

        Samples at or past an item's length are read as zeros whatever the padding holds, so
        item b's first frame_counts[b] frames equal encoding `audio[b, :lengths[b]]` alone (the
        encoder is causal); its later frames encode silence and are not part of the clip."""
        audio = audio.reshape(-1, 1, audio.shape[-1]) if audio.dim() < 3 else audio
        batch, total = audio.shape[0], audio.shape[-1]
        if lengths is None:
            valid = torch.full((batch,), total, dtype=torch.long)
        else:
            valid = torch.as_tensor(lengths).detach().to("cpu", torch.long).flatten()
            if valid.numel() != batch:
                raise ValueError(f"lengths has {valid.numel()} entries for a batch of {batch}")
            if bool((valid < 0).any()) or bool((valid > total).any()):
                raise ValueError(f"lengths must be within 0..{total}, got {valid.tolist()}")
        frames = math.ceil(total / self.frame_length)
        audio = F.pad(audio.to(self.device, self.dtype), (0, frames * self.frame_length - total))
        if bool((valid < total).any()):
            samples = torch.arange(audio.shape[-1], device=self.device)
            audio = audio.masked_fill(samples >= valid.to(self.device)[:, None, None], 0)
        codes = self.quantizer.encode(self.encoder(audio))
        return codes, (valid + self.frame_length - 1) // self.frame_length

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, num_codebooks, frames] or [num_codebooks, frames] -> audio [B, 1, samples]."""
        codes = codes[None] if codes.dim() == 2 else codes
        return self.decoder(self.quantizer.decode(codes.long().to(self.device)))

    def stream_pool(self, max_streams: int):
        """A pool of streaming-decode states; see `codec_stream.CodecStreamPool`."""
        return CodecStreamPool(self, max_streams)

    def stream_state_shapes(self) -> dict[str, tuple[int, ...]]:
        """What a stream carries between steps (`codec_stream.stream_state_shapes`)."""
        return stream_state_shapes(self)

    def decode_step(
        self, codes: Tensor, valid: Tensor, positions: Tensor, states: dict[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """One batched streaming step (`codec_stream.decode_step`)."""
        return decode_step(self, codes, valid, positions, states)

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.model[0].conv.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.decoder.model[0].conv.weight.device


# ---------------------------------------------------------------- checkpoint layout and loading


def find_codec_config(path: Path) -> CodecConfig:
    """`codec_config.json` beside the file, or a `config.json` that is a codec config, else defaults."""
    for name in ("codec_config.json", "config.json"):
        candidate = path.parent / name
        if candidate.is_file():
            values = json.loads(candidate.read_text())
            if "encoder_rates" in values:
                return CodecConfig.from_dict(values)
    return CodecConfig()


def codec_file(directory: str | Path) -> Path:
    """The codec a checkpoint directory ships: `codec.pth` (S1-mini, S2), else Fish Speech 1.5's
    Firefly generator; `codec.pth` when neither is there (for the caller's error message)."""
    directory = Path(directory)
    for name in ("codec.pth", FIREFLY_FILE):
        if (directory / name).is_file():
            return directory / name
    return directory / "codec.pth"


def load_codec(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    config: CodecConfig | dict | None = None,
):  # fmt: skip
    """Build the codec and load its file (or the one `codec_file` finds in a directory): the
    modded DAC `Codec` from its config, or, for a Firefly generator (Fish Speech 1.5, told by its
    tensor names), `codec_firefly.FireflyCodec`. Both have the same public surface."""
    path = Path(path)
    path = codec_file(path) if path.is_dir() else path
    state = read_codec_state_dict(path)
    if is_firefly_state_dict(state):
        return load_firefly_codec(path, device, dtype, config=config, state=state)
    if isinstance(config, dict):
        config = CodecConfig.from_dict(config)
    config = config or find_codec_config(path)
    with torch.device("meta"):
        codec = Codec(config)
    codec.load_state_dict(fold_state_dict(codec, state), assign=True)
    return codec.to(device=device, dtype=dtype).eval().requires_grad_(False)


def random_state_dict(config: CodecConfig, seed: int = 0, legacy: bool = False) -> dict[str, Tensor]:
    """Random weights in the official layout, scaled so activations stay O(1) through the net."""
    with torch.device("meta"):
        codec = Codec(config)
    return random_weights(codec, seed, legacy)


def random_codec(config: CodecConfig | None = None, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> Codec:  # fmt: skip
    """A random-weight codec in memory, exactly as `save_random_codec` + `load_codec` would give."""
    config = config or CodecConfig()
    with torch.device("meta"):
        codec = Codec(config)
    codec.load_state_dict(fold_state_dict(codec, random_state_dict(config, seed)), assign=True)
    return codec.to(device=device, dtype=dtype).eval().requires_grad_(False)


def save_random_codec(path: str | Path, config: CodecConfig | dict | None = None, seed: int = 0,
                      legacy: bool = False) -> Path:  # fmt: skip
    """Write a random-weight `codec.pth` (official format) plus `codec_config.json` beside it."""
    config = CodecConfig.from_dict(config) if isinstance(config, dict) else (config or CodecConfig())
    path = Path(path)
    path = path / "codec.pth" if path.is_dir() else path
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(random_state_dict(config, seed, legacy), path)
    (path.parent / "codec_config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return path
