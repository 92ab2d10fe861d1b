"""`shoal demo-checkpoint DIR`: a small random-weight model + codec that runs everything end to end.

For a machine without the real weights (CI, a laptop, a fresh GPU box): the directory has the
exact S2-Pro on-disk layout (nested config.json, sharded safetensors + index, tokenizer.json with
the Fish specials, a byte-level BPE that encodes any text, and `<|semantic:i|>` tokens) and a
`codec.pth` in the official codec format, all loaded by the same code as the real checkpoint.
The dimensions are tiny, so the CPU generates many frames per second. The weights are random:
the audio is noise, and generation stops at `<|im_end|>` only by chance.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shoal.models.codec import CodecConfig, save_random_codec
from shoal.models.codec_modules import TransformerConfig
from shoal.models.config import ModelConfig
from shoal.models.writer import write_checkpoint

CODEC_FILE = "codec.pth"
NOISE_WARNING = (
    "NOTE: this is a RANDOM-WEIGHT demo checkpoint. Everything runs end to end, but the audio it "
    "produces is noise, not speech."
)

# The S2 vocabulary structure at a small scale: 12 Fish/Qwen specials (<|im_end|> at 2), the 256
# byte tokens, then the semantic tokens, then <|pad|> / <|audio_pad|> at the top of the vocab.
DEMO_CODEBOOK_SIZE = 256
DEMO_SEMANTIC_BEGIN_ID = 288
DEMO_VOCAB_SIZE = 576
DEMO_IM_END_ID = 2


def demo_model_config() -> ModelConfig:
    """S2-family config (QK-norm slow model, tied head, post-norm fast input), ~1.5 M parameters."""
    return ModelConfig(
        model_type="fish_qwen3_omni", family="s2", vocab_size=DEMO_VOCAB_SIZE, dim=128, n_layer=4, n_head=4,
        n_local_heads=2, head_dim=32, intermediate_size=384, max_seq_len=4096, rope_base=1000000,
        norm_eps=1e-6, attention_qk_norm=True, tie_word_embeddings=True, scale_codebook_embeddings=True,
        norm_fastlayer_input=True, codebook_size=DEMO_CODEBOOK_SIZE, num_codebooks=10, n_fast_layer=2,
        fast_head_dim=32, fast_intermediate_size=256, fast_attention_qk_norm=False, initializer_range=0.02,
        semantic_begin_id=DEMO_SEMANTIC_BEGIN_ID,
        semantic_end_id=DEMO_SEMANTIC_BEGIN_ID + DEMO_CODEBOOK_SIZE - 1, im_end_id=DEMO_IM_END_ID,
    )  # fmt: skip


def demo_codec_config() -> CodecConfig:
    """The official codec's structure and frame rate (44.1 kHz, 2048 samples = 1 frame, 1 semantic
    + 9 residual codebooks) with narrow channels and one-layer transformers."""
    return CodecConfig(
        sample_rate=44100, encoder_dim=8, encoder_rates=[2, 4, 8, 8], decoder_dim=64,
        decoder_rates=[8, 8, 4, 2], encoder_transformer_layers=[0, 0, 0, 1],
        decoder_transformer_layers=[0, 0, 0, 0], latent_dim=64,
        general=TransformerConfig(n_layer=1, n_head=2, dim=128, intermediate_size=384, head_dim=64),
        n_codebooks=9, codebook_size=DEMO_CODEBOOK_SIZE, codebook_dim=8, downsample_factor=[2, 2],
        semantic_codebook_size=DEMO_CODEBOOK_SIZE, window_size=128, encoder_window_size=512,
        transformer=TransformerConfig(n_layer=1, n_head=2, dim=64, intermediate_size=192, head_dim=32),
    )  # fmt: skip


def write_demo_checkpoint(directory: str | Path, seed: int = 0) -> Path:
    """Write the model (S2 layout) and `codec.pth` into `directory`; returns the directory."""
    directory = Path(directory)
    config = demo_model_config()
    write_checkpoint(directory, config, seed=seed, num_shards=2)
    save_random_codec(directory / CODEC_FILE, demo_codec_config(), seed=seed)
    return directory


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, help="where to write the checkpoint (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a checkpoint already in the directory"
    )


def run(args: argparse.Namespace) -> int:
    directory: Path = args.directory
    if (directory / "config.json").exists() and not args.overwrite:
        print(
            f"error: {directory} already holds a checkpoint; pass --overwrite to replace it", file=sys.stderr
        )
        return 1
    if directory.exists() and not directory.is_dir():
        print(f"error: {directory} exists and is not a directory", file=sys.stderr)
        return 1
    try:
        write_demo_checkpoint(directory, seed=args.seed)
    except OSError as error:  # unwritable place, disk full, ...
        print(f"error: could not write the demo checkpoint to {directory}: {error}", file=sys.stderr)
        return 1
    print(f"Wrote a demo S2-layout checkpoint and {CODEC_FILE} to {directory}")
    print(NOISE_WARNING)
    print(f'Try: shoal synth "Hello there." --checkpoint {directory} -o hello.wav')
    return 0
