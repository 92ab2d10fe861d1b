"""The engine's tuning choices in one frozen dataclass, and the one reader of `SHOAL_*` overrides.

Every default is the variant a measurement chose; docs/performance.md's ledger says which run
decided it and by how much. Nothing here imports torch: the kernels, the engine and the CLI all
read `TUNING`, the process's values (defaults, then `SHOAL_<FIELD>` from the environment, read
once at import). A benchmark that compares variants in one process builds them with
`dataclasses.replace` and hands them to the decode step (`shoal bench ab`); nothing is patched.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "SHOAL_"


def environment(name: str, default: str | None = None) -> str | None:
    """The value of `SHOAL_<name>`: the only way any Shoal module reads its environment."""
    return os.environ.get(ENV_PREFIX + name, default)


_CONFIG_TABLES = ("attention_configs", "attention_configs_fp8_kv", "gemm_configs")


def _frozen(mapping: Mapping | None = None) -> Mapping:
    return types.MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Tuning:
    """What the engine runs by default. Field groups follow the decode step's order."""

    # Engine loop: launch step n+1 before reading step n's frames; prefill graphs on a stream of
    # their own; the step's last kernel advances the next step's metadata on the device.
    overlap_steps: bool = True
    overlap_prefill: bool = True
    advance_on_device: bool = True

    # Norms: batches of at most `norm_split_max_rows` rows split each row over programs of
    # `norm_slice_groups_narrow` 128-column groups (`..._wide` from `norm_slice_wide_from_rows`
    # rows) and write the next W8A8 projection's input quantized; larger batches keep one program
    # per row. `norm_slice_groups` forces one size (0: never split). `norm_max_registers`: None for
    # `kernels.norm_rope.NORM_MAX_REGISTERS`, 0 for ptxas's choice.
    norm_split_max_rows: int = 16
    norm_slice_groups: int | None = None
    norm_slice_groups_narrow: int = 4
    norm_slice_groups_wide: int = 8
    norm_slice_wide_from_rows: int = 9
    norm_max_registers: int | None = None
    # The attention writes the o projection's input quantized (free: its merge quantizes a head).
    fuse_attention_quant: bool = True

    # Split-K partials left to the kernel that reads the GEMM's output: the norm after o and down,
    # the QK-norm/RoPE/KV write after qkv, the fused fast attention up to a batch size.
    norm_reduces_partials: bool = True
    rope_reduces_partials: bool = True
    fast_attention_partials_max_batch: int = 16

    # Fast transformer: QK-norm/RoPE/KV write and attention as one launch per layer, except for
    # batches two_launch_fast_from..two_launch_fast_to (inclusive), which keep two launches.
    two_launch_fast_from: int = 17
    two_launch_fast_to: int = 39
    packed_pairs: bool = True  # the fused fast attention reads bf16 pairs as 32-bit words
    words_min_rows: int = 8  # ... from this many rows on

    # Output heads: `kernels/output_head.py` up to this many rows, cuBLAS above.
    head_kernel_max_rows: int = 1
    head_kernel_reads_fp8: bool = True  # a rounded fast head is read as its e4m3 codes
    head_rows_per_program: int = 16
    fp8_head_rows_per_program: int = 32
    head_chunk: int = 512
    fp8_head_chunk: int = 512

    # Sampling kernels: programs per sampled row (None: by the row's width), warps per program.
    sample_chunks: int | None = None
    sample_warps: int = 8

    # FP8 prefill GEMMs: None follows `engine.fp8_weights.VARIANT_TABLE`; "bf16", "scaled_mm" or
    # "w8a8" forces one variant for every prefill bucket.
    fp8_prefill: str | None = None

    # Programmatic dependent launch (Hopper): on, except for the kernel families named here.
    pdl: bool = True
    pdl_skip: frozenset[str] = frozenset()

    # Codec: a dilated streaming conv runs as an undilated (k x 1) conv over its rows viewed as
    # [rows / d, d] phases (`models.codec_modules.CausalConv1d`); same arithmetic, faster than
    # cuDNN's dilated kernels (docs/codec.md, plan item 1). None: on CUDA only.
    codec_phase_split_dilations: bool | None = None

    # Codec: the transformer's streaming step through torch.compile (TorchInductor fuses the
    # norms, RoPE, layer scales and SiLU around cuBLAS GEMMs and attention; docs/codec.md, plan
    # item 2). None: on CUDA only (on the CPU Inductor's C++ build costs minutes of start-up).
    codec_compile_transformer: bool | None = None

    # Kernel configs replacing a tuned table's entry: decode attention by batch bucket (bf16 and
    # e4m3 KV), the FP8 GEMM by (N, K, M bucket). Empty: the tables in the kernel modules.
    attention_configs: Mapping[int, Any] = field(default_factory=_frozen)
    attention_configs_fp8_kv: Mapping[int, Any] = field(default_factory=_frozen)
    gemm_configs: Mapping[tuple[int, int, int], Any] = field(default_factory=_frozen)

    def __post_init__(self) -> None:
        if self.fp8_prefill not in (None, "bf16", "scaled_mm", "w8a8"):
            raise ValueError(f"fp8_prefill must be bf16, scaled_mm or w8a8, got {self.fp8_prefill!r}")
        if self.sample_chunks is not None and (
            self.sample_chunks < 1 or self.sample_chunks & (self.sample_chunks - 1)
        ):
            raise ValueError(f"sample_chunks must be a power of two >= 1, got {self.sample_chunks}")
        for name in _CONFIG_TABLES:
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    def splits_norm_rows(self, rows: int) -> bool:
        """Whether a batch of `rows` rows splits its norm rows (and fuses their quantization)."""
        return 0 < rows <= self.norm_split_max_rows

    def norm_slice_groups_for(self, rows: int) -> int:
        """128-column groups per norm program for a batch of `rows` rows; 0: one program per row."""
        if not self.splits_norm_rows(rows):
            return 0
        if self.norm_slice_groups is not None:
            return self.norm_slice_groups
        wide = rows >= self.norm_slice_wide_from_rows
        return self.norm_slice_groups_wide if wide else self.norm_slice_groups_narrow

    def fuses_fast_attention(self, batch: int) -> bool:
        """Whether fast passes of this batch run the one-launch fused fast attention."""
        return not self.two_launch_fast_from <= batch <= self.two_launch_fast_to

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Tuning:
        """Defaults with `SHOAL_<FIELD>` overrides (e.g. SHOAL_OVERLAP_STEPS=0, SHOAL_PDL_SKIP=
        attention,norm). A value that does not parse is refused: a typo must not measure the default."""
        environ = os.environ if environ is None else environ
        hints = typing.get_type_hints(cls)
        changes = {}
        for item in dataclasses.fields(cls):
            text = environ.get(ENV_PREFIX + item.name.upper())
            if text is not None and item.name not in _CONFIG_TABLES:
                changes[item.name] = _parse(item.name, hints[item.name], text.strip())
        return cls(**changes)

    def with_fields(self, **changes: str | int | bool | None) -> Tuning:
        """A copy with fields set from values or their text (`shoal bench ab`'s `step:` parts)."""
        hints = typing.get_type_hints(type(self))
        parsed = {
            name: _parse(name, hints[name], value) if isinstance(value, str) else value
            for name, value in changes.items()
        }
        unknown = set(parsed) - {item.name for item in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown tuning fields: {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **parsed)


def _parse(name: str, hint: Any, text: str) -> Any:
    optional = type(None) in typing.get_args(hint)
    if optional and text.lower() in ("", "none", "auto"):
        return None
    base = next(arg for arg in typing.get_args(hint) if arg is not type(None)) if optional else hint
    try:
        if base is bool:
            if text.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(text)
            return text.lower() in ("1", "true", "yes", "on")
        if base is int:
            return int(text)
        if typing.get_origin(base) is frozenset:
            return frozenset(part.strip() for part in text.split(",") if part.strip())
        return text
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}: cannot read {text!r} as {base}") from None


TUNING = Tuning.from_environment()
