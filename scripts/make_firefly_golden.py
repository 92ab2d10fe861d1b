"""Write `tests/data/firefly_tiny`: a tiny Fish Speech 1.5 codec ("Firefly GAN VQ") with random
weights in the official file format, and the reference implementation's outputs for it.

The reference is fish-speech's own code at tag v1.5.1 (`fish_speech/models/vqgan/modules/
firefly.py` and `fsq.py`, `fish_speech/utils/spectrogram.py`), run on the CPU in float32 with
vector_quantize_pytorch 1.14.24 (the version fish-speech 1.5 pins), einops, einx and torchaudio.
None of that is a dependency of Shoal: run this once in a separate environment, e.g.

    python -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.9.1 'torchaudio==2.9.*' \\
        einops einx vector_quantize_pytorch==1.14.24
    git -C fish-speech archive v1.5.1 fish_speech/models/vqgan fish_speech/utils/spectrogram.py \\
        | tar -x -C /tmp/fs151
    /tmp/ref/bin/python scripts/make_firefly_golden.py --fish-speech /tmp/fs151

The files it writes (`codec.pth`: the reference model's own `state_dict()`; `codec_config.json`:
the same constructor parameters in `FireflyConfig`'s names; `golden.pt`), and
`tests/data/firefly_full_manifest.json` (every tensor name and shape of the reference built with
the shipped configuration, `firefly_gan_vq.yaml`: what the real generator file holds) are what
`tests/test_codec_firefly.py` reads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import torch

# The tiny codec: every kind of layer of the shipped one, a 64-sample frame at 8 kHz.
CONFIG = {
    "sample_rate": 8000, "n_fft": 64, "win_length": 64, "hop_length": 16, "n_mels": 16,
    "encoder_depths": [1, 2], "encoder_dims": [16, 32], "encoder_kernel_size": 7,
    "fsq_groups": 4, "fsq_levels": [8, 5, 5, 5], "downsample_factor": [2, 2],
    "upsample_rates": [4, 2, 2], "upsample_kernel_sizes": [8, 4, 4],
    "resblock_kernel_sizes": [3, 5], "resblock_dilation_sizes": [[1, 3, 5], [1, 2, 3]],
    "decoder_channels": 32, "pre_conv_kernel_size": 7, "post_conv_kernel_size": 7,
}  # fmt: skip


def load_reference(root: Path) -> dict[str, types.ModuleType]:
    """The reference modules, imported from files under `root` without the rest of fish-speech."""
    modules = {}
    for name in ("fish_speech", "fish_speech.models", "fish_speech.models.vqgan",
                 "fish_speech.models.vqgan.modules", "fish_speech.utils"):  # fmt: skip
        package = types.ModuleType(name)
        package.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = package
    for name in ("fish_speech.models.vqgan.modules.firefly", "fish_speech.models.vqgan.modules.fsq",
                 "fish_speech.utils.spectrogram"):  # fmt: skip
        spec = importlib.util.spec_from_file_location(name, root / (name.replace(".", "/") + ".py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules[name.rsplit(".", 1)[1]] = module
    return modules


# fish-speech 1.5's `firefly_gan_vq.yaml`, in the same names.
SHIPPED = {
    "sample_rate": 44100, "n_fft": 2048, "win_length": 2048, "hop_length": 512, "n_mels": 160,
    "encoder_depths": [3, 3, 9, 3], "encoder_dims": [128, 256, 384, 512], "encoder_kernel_size": 7,
    "fsq_groups": 8, "fsq_levels": [8, 5, 5, 5], "downsample_factor": [2, 2],
    "upsample_rates": [8, 8, 2, 2, 2], "upsample_kernel_sizes": [16, 16, 4, 4, 4],
    "resblock_kernel_sizes": [3, 7, 11], "resblock_dilation_sizes": [[1, 3, 5]] * 3,
    "decoder_channels": 512, "pre_conv_kernel_size": 13, "post_conv_kernel_size": 13,
}  # fmt: skip


def build_reference(ref: dict[str, types.ModuleType], c: dict = CONFIG) -> torch.nn.Module:
    firefly, fsq, spectrogram = ref["firefly"], ref["fsq"], ref["spectrogram"]
    return firefly.FireflyArchitecture(
        spec_transform=spectrogram.LogMelSpectrogram(
            sample_rate=c["sample_rate"], n_mels=c["n_mels"], n_fft=c["n_fft"], hop_length=c["hop_length"],
            win_length=c["win_length"],
        ),
        backbone=firefly.ConvNeXtEncoder(
            input_channels=c["n_mels"], depths=c["encoder_depths"], dims=c["encoder_dims"],
            drop_path_rate=0.2, kernel_size=c["encoder_kernel_size"],
        ),
        head=firefly.HiFiGANGenerator(
            hop_length=c["hop_length"], upsample_rates=c["upsample_rates"],
            upsample_kernel_sizes=c["upsample_kernel_sizes"],
            resblock_kernel_sizes=c["resblock_kernel_sizes"],
            resblock_dilation_sizes=c["resblock_dilation_sizes"], num_mels=c["encoder_dims"][-1],
            upsample_initial_channel=c["decoder_channels"], pre_conv_kernel_size=c["pre_conv_kernel_size"],
            post_conv_kernel_size=c["post_conv_kernel_size"],
        ),
        quantizer=fsq.DownsampleFiniteScalarQuantize(
            input_dim=c["encoder_dims"][-1], n_groups=c["fsq_groups"], n_codebooks=1, levels=c["fsq_levels"],
            downsample_factor=c["downsample_factor"],
        ),
    ).eval()  # fmt: skip


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights that keep activations O(1) through the net (the reference's own init makes the
    decoder nearly silent), so that the comparison exercises every layer."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            shape = tuple(param.shape)
            if leaf == "gamma":
                value = torch.full(shape, 0.3)
            elif leaf == "bias":
                value = 0.02 * torch.randn(shape, generator=gen)
            elif leaf == "weight" and param.dim() == 1:
                value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            elif leaf == "original0":  # weight norm's g: a length per row of dim 0 (SiLU halves small values)
                value = 1.4 + 0.4 * torch.rand(shape, generator=gen)
                owner = model.get_submodule(name.split(".parametrizations")[0])
                if isinstance(owner, torch.nn.ConvTranspose1d):  # rows are inputs: keep the output's scale
                    value = value * math.sqrt(owner.out_channels * owner.stride[0] / owner.in_channels)
            else:
                owner = (
                    model.get_submodule(name.split(".parametrizations")[0])
                    if "parametrizations" in name
                    else None
                )
                transposed = isinstance(owner, torch.nn.ConvTranspose1d)
                fan_in = shape[0] * shape[2] / owner.stride[0] if transposed else math.prod(shape[1:])
                value = 0.8 * torch.randn(shape, generator=gen) / math.sqrt(fan_in)
            param.copy_(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fish-speech", type=Path, required=True, help="a fish-speech v1.5.1 tree")
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "tests/data/firefly_tiny")
    args = parser.parse_args()
    torch.manual_seed(0)
    reference = load_reference(args.fish_speech)
    full = build_reference(reference, SHIPPED)
    manifest = {name: list(t.shape) for name, t in full.state_dict().items()}
    manifest_path = args.out.parent / "firefly_full_manifest.json"
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    params = sum(p.numel() for p in full.parameters())
    print(f"wrote {manifest_path}: {len(manifest)} tensors, {params / 1e6:.1f}M parameters")
    model = build_reference(reference)
    randomize(model, seed=1)
    gen = torch.Generator().manual_seed(2)
    samples = 1000  # not whole frames: 62 mel frames, 16 codes (the last from a padded pair)
    t = torch.arange(samples) / CONFIG["sample_rate"]
    audio = 0.4 * torch.sin(2 * math.pi * 220 * t) + 0.2 * torch.sin(2 * math.pi * 1330 * t)
    audio = audio + 0.05 * torch.randn(samples, generator=gen)
    decode_codes = torch.randint(0, 1000, (1, CONFIG["fsq_groups"], 24), generator=gen)
    with torch.no_grad():
        mel = model.spec_transform(audio[None, None])
        codes, code_lengths = model.encode(audio[None, None], torch.tensor([samples]))
        decoded, _ = model.decode(decode_codes, torch.tensor([24]))
        prefix, _ = model.decode(decode_codes[..., :10], torch.tensor([10]))
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), args.out / "codec.pth")
    (args.out / "codec_config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    torch.save(
        {
            "audio_in": audio, "mel": mel[0], "codes": codes, "code_lengths": code_lengths,
            "decode_codes": decode_codes, "decode_audio": decoded, "decode_prefix10_audio": prefix,
        },
        args.out / "golden.pt",
    )  # fmt: skip
    print(f"wrote {args.out}: codes {list(codes.shape)} ({codes.unique().numel()} distinct), "
          f"decoded {list(decoded.shape)} (std {decoded.std():.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
