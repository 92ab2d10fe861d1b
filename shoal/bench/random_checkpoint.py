"""Random-weight checkpoints in the official S2 layout, written fast, for serving benchmarks.

`python -m shoal.bench.random_checkpoint DIR --size s2-pro|demo --device cuda|cpu` writes what
`shoal serve --checkpoint DIR` loads: the nested `config.json`, sharded safetensors + index (bf16),
`tokenizer.json` (`shoal.models.writer`'s byte-level tokenizer with the Fish specials) and a
random `codec.pth` + `codec_config.json` (`save_random_codec`). `s2-pro` is the full-size S2-Pro
(4.56 B parameters, 9.1 GB of bf16; the official config, `golden/s2_pro_full_manifest.json`) and
the full-size codec; `demo` is `shoal demo-checkpoint`'s small model and codec.

The weights follow the writer's random init (`writer.random_state_dict`: N(0, initializer_range)
matrices, zero biases, unit norms) but are drawn directly in bf16 on `--device` and streamed into
the shard files tensor by tensor, several shards at once, while the codec is drawn on the CPU in
a second thread: the GPU box writes S2-Pro in seconds instead of building 18 GB of fp32 on the
CPU first. The audio is noise and generation stops at `<|im_end|>` only by chance, so every
request runs to its `max_new_tokens`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from shoal.models.checkpoint import S2_INDEX_FILE, native_to_file_key
from shoal.models.codec import CodecConfig, save_random_codec
from shoal.models.config import ModelConfig, parse_config, to_official_dict
from shoal.models.writer import tensor_plan, write_s2_tokenizer

SIZES = ("s2-pro", "demo")
CODEC_FILE = "codec.pth"

# fishaudio/s2-pro's config.json (as in golden/s2_pro_full_manifest.json).
S2_PRO_CONFIG = {
    "model_type": "fish_qwen3_omni",
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "pad_token_id": 151669,
    "audio_pad_token_id": 151677,
    "semantic_start_token_id": 151678,
    "semantic_end_token_id": 155773,
    "text_config": {
        "model_type": "fish_qwen3", "dim": 2560, "n_layer": 36, "n_head": 32, "n_local_heads": 8,
        "head_dim": 128, "intermediate_size": 9728, "max_seq_len": 32768, "rope_base": 1000000,
        "norm_eps": 1e-06, "vocab_size": 155776, "attention_qk_norm": True, "attention_qkv_bias": False,
        "attention_o_bias": False, "tie_word_embeddings": True,
    },
    "audio_decoder_config": {
        "model_type": "fish_qwen3_audio_decoder", "dim": 2560, "text_dim": 2560, "n_layer": 4,
        "n_head": 32, "n_local_heads": 8, "head_dim": 128, "intermediate_size": 9728, "max_seq_len": 11,
        "num_codebooks": 10, "vocab_size": 4096, "rope_base": 1000000, "norm_eps": 1e-06,
        "attention_qk_norm": False, "tie_word_embeddings": False, "use_moe": False,
    },
}  # fmt: skip

# safetensors dtype names
_SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip


def model_config(size: str) -> ModelConfig:
    if size == "s2-pro":
        return parse_config(S2_PRO_CONFIG)
    if size == "demo":
        from shoal.demo import demo_model_config

        return demo_model_config()
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")


def codec_config(size: str) -> CodecConfig:
    if size == "s2-pro":
        return CodecConfig()  # the official full-size codec
    if size == "demo":
        from shoal.demo import demo_codec_config

        return demo_codec_config()
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")


def special_ids(config: ModelConfig, size: str) -> dict[str, int]:
    """`<|pad|>` and `<|audio_pad|>`: S2-Pro's own ids at full size, otherwise the writer's rule
    (the highest ids outside `<|im_end|>` and the semantic range)."""
    if size == "s2-pro":
        return {
            "<|pad|>": S2_PRO_CONFIG["pad_token_id"],
            "<|audio_pad|>": S2_PRO_CONFIG["audio_pad_token_id"],
        }
    taken = {config.im_end_id, *range(config.semantic_begin_id, config.semantic_end_id + 1)}
    free = (i for i in range(config.vocab_size - 1, -1, -1) if i not in taken)
    return {"<|pad|>": next(free), "<|audio_pad|>": next(free)}


# ---- weights ----------------------------------------------------------------------------------


def split_shards(sizes: list[int], num_shards: int) -> list[list[int]]:
    """Consecutive index groups of about equal byte totals: at most `num_shards`, none empty
    (fewer when single items are larger than a shard)."""
    num_shards = max(1, min(num_shards, len(sizes)))
    target = max(1, sum(sizes)) / num_shards
    groups: list[list[int]] = [[] for _ in range(num_shards)]
    start = 0
    for index, size in enumerate(sizes):
        groups[min(num_shards - 1, int((start + size / 2) / target))].append(index)
        start += size
    return [group for group in groups if group]


def safetensors_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict) -> bytes:
    """The length-prefixed JSON header of a safetensors file whose data follows in this order."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in entries:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }  # fmt: skip
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def _write_tensor(file, tensor: Tensor) -> None:
    cpu = tensor.detach().contiguous().cpu()
    file.write(memoryview(cpu.reshape(-1).view(torch.uint8).numpy()))


def write_shard(
    path: Path, items: list[tuple[str, str, tuple[int, ...], str]], *, std: float, dtype: torch.dtype,
    device: torch.device, seed: int,
) -> int:  # fmt: skip
    """Draw each tensor on `device` and stream it into a safetensors file; items are (file key,
    native name, shape, init). Returns the bytes of tensor data written."""
    generator = torch.Generator(device=device).manual_seed(seed)
    header = safetensors_header([(key, dtype, shape) for key, _, shape, _ in items], {"format": "pt"})
    written = 0
    with open(path, "wb") as file:
        file.write(header)
        for _, _, shape, init in items:
            if init == "ones":
                tensor = torch.ones(shape, dtype=dtype, device=device)
            elif init == "zeros":
                tensor = torch.zeros(shape, dtype=dtype, device=device)
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)
            _write_tensor(file, tensor)
            written += tensor.numel() * tensor.element_size()
    return written


def write_weights(
    directory: Path, config: ModelConfig, *, device: torch.device, dtype: torch.dtype = torch.bfloat16,
    num_shards: int = 8, seed: int = 0, workers: int = 4,
) -> int:  # fmt: skip
    """The sharded safetensors files + index of `config`'s random weights; returns total bytes."""
    plan = [(native_to_file_key(name, "s2"), name, shape, init) for name, shape, init in tensor_plan(config)]
    element = torch.empty((), dtype=dtype).element_size()
    groups = split_shards([torch.Size(shape).numel() * element for _, _, shape, _ in plan], num_shards)
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]

    def one(index: int) -> int:
        items = [plan[i] for i in groups[index]]
        std = config.initializer_range
        return write_shard(
            directory / names[index], items, std=std, dtype=dtype, device=device, seed=seed * 1000 + index
        )

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(groups)))) as pool:
        total = sum(pool.map(one, range(len(groups))))
    weight_map = {plan[i][0]: names[g] for g, group in enumerate(groups) for i in group}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / S2_INDEX_FILE).write_text(json.dumps(index, indent=2))
    return total


# ---- the checkpoint ---------------------------------------------------------------------------


def write_metadata(directory: Path, config: ModelConfig, size: str) -> dict:
    """`tokenizer.json` (+ `tokenizer_config.json`) and `config.json`; returns the config dict."""
    extra = special_ids(config, size)
    write_s2_tokenizer(directory, config, extra)
    official = to_official_dict(config, {"pad_token_id": extra["<|pad|>"]})
    official["audio_pad_token_id"] = extra["<|audio_pad|>"]
    (directory / "config.json").write_text(json.dumps(official, indent=2), encoding="utf-8")
    return official


def write_random_checkpoint(
    directory: str | Path, size: str = "s2-pro", *, device: str | torch.device = "cpu", seed: int = 0,
    num_shards: int | None = None, codec: bool = True, log=print,
) -> ModelConfig:  # fmt: skip
    """Write the `size` model (S2 layout, bf16) and, with `codec`, `codec.pth` into `directory`.
    Returns the model config that `load_model` reads back."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    device = torch.device(device)
    config = model_config(size)
    started = time.perf_counter()
    codec_error: list[BaseException] = []
    codec_thread = None
    if codec:

        def write_codec() -> None:
            try:
                save_random_codec(directory / CODEC_FILE, codec_config(size), seed=seed)
                log(f"codec.pth written in {time.perf_counter() - started:.1f} s")
            except BaseException as error:  # re-raised in the main thread
                codec_error.append(error)

        codec_thread = threading.Thread(target=write_codec, name="random-codec")
        codec_thread.start()
    write_metadata(directory, config, size)
    shards = num_shards or (8 if size == "s2-pro" else 2)
    total = write_weights(directory, config, device=device, num_shards=shards, seed=seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    rate = total / 1e9 / seconds
    log(f"model weights: {total / 1e9:.2f} GB bf16 in {shards} shards, {seconds:.1f} s ({rate:.2f} GB/s)")
    if codec_thread is not None:
        codec_thread.join()
        if codec_error:
            raise codec_error[0]
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shoal.bench.random_checkpoint",
        description="write a random-weight S2-layout checkpoint (model + codec) for serving benchmarks",
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--size", choices=SIZES, default="s2-pro")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the weights are drawn (default: cuda when available)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=None, help="default: 8 for s2-pro, 2 for demo")
    parser.add_argument("--no-codec", action="store_true", help="skip codec.pth")
    parser.add_argument("--overwrite", action="store_true", help="empty the directory first")
    args = parser.parse_args(argv)
    if args.directory.exists() and any(args.directory.iterdir()):
        if not args.overwrite:
            print(f"error: {args.directory} is not empty; pass --overwrite", file=sys.stderr)
            return 1
        shutil.rmtree(args.directory)
    started = time.perf_counter()
    write_random_checkpoint(
        args.directory, args.size, device=args.device, seed=args.seed, num_shards=args.shards,
        codec=not args.no_codec, log=lambda text: print(text, flush=True),
    )  # fmt: skip
    seconds = time.perf_counter() - started
    print(f"wrote the random {args.size} checkpoint to {args.directory} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
