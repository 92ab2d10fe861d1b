"""The tuned tables load from `shoal/kernels/tuned/*.json` into the configs the kernels used
before they became data (the values below), the sweeps' writers merge winners into them, and the
package ships the files."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

from shoal.bench.attention import per_batch_winners
from shoal.bench.engine import sweep_winners
from shoal.engine import fp8_weights
from shoal.kernels import attention, fp8_gemm, tuned
from shoal.kernels.attention import AttentionConfig
from shoal.kernels.fp8_gemm import GemmConfig

# Every field of each config, in the dataclass's declaration order (`dataclasses.astuple`).
# AttentionConfig: block_n, block_m, num_warps, num_stages, target_programs, min_split_tokens,
# max_splits, fused_merge, split_block_n, max_registers
TUNED_DECODE_CONFIGS = {
    1: (32, 16, 4, 3, 264, 64, 32, True, 0, 0),
    4: (128, 16, 4, 3, 264, 64, 32, True, 64, 0),
    8: (128, 16, 4, 3, 264, 256, 32, True, 64, 0),
    16: (128, 16, 4, 3, 264, 64, 32, True, 32, 0),
    64: (32, 16, 4, 3, 264, 256, 32, False, 0, 0),
}
TUNED_DECODE_CONFIGS_FP8_KV = {
    1: (128, 16, 4, 2, 264, 64, 32, True, 0, 0),
    16: (128, 16, 4, 2, 264, 256, 32, True, 0, 168),
    64: (128, 16, 4, 3, 264, 256, 32, False, 0, 0),
}
# GemmConfig (booleans as 1/0): block_m, block_n, split_k, num_warps, num_stages, swap_ab, tma,
# bf16_partials, scales_ahead, gluon, tiles_before_wait, tma_scales, vector_stores
TUNED_CONFIGS = {
    (2560, 4096, 1): (16, 64, 14, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (2560, 4096, 2): (16, 64, 14, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (2560, 4096, 4): (16, 64, 14, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (2560, 4096, 8): (16, 64, 14, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (2560, 4096, 16): (16, 64, 14, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (2560, 9728, 1): (16, 64, 14, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (2560, 9728, 2): (16, 64, 14, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (2560, 9728, 4): (16, 64, 14, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (2560, 9728, 8): (16, 64, 14, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (2560, 9728, 16): (16, 64, 14, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (6144, 2560, 1): (16, 64, 6, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (6144, 2560, 2): (16, 64, 6, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (6144, 2560, 4): (16, 64, 6, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (6144, 2560, 8): (16, 64, 3, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (6144, 2560, 16): (16, 64, 3, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (19456, 2560, 1): (16, 64, 2, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (19456, 2560, 2): (16, 64, 2, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (19456, 2560, 4): (16, 64, 2, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (19456, 2560, 8): (16, 64, 2, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
    (19456, 2560, 16): (16, 64, 2, 4, 4, 1, 0, 0, 0, 0, 0, 0, 0),
}
TUNED_CONFIGS_FP8 = {
    (2560, 4096, 1): (16, 64, 7, 4, 3, 1, 0, 1, 0, 1, 2, 0, 0),
    (2560, 4096, 2): (16, 64, 7, 4, 3, 1, 0, 1, 0, 1, 2, 0, 1),
    (2560, 4096, 4): (16, 64, 7, 4, 3, 1, 0, 1, 0, 1, 2, 0, 1),
    (2560, 4096, 8): (16, 64, 4, 4, 4, 1, 0, 1, 0, 1, 2, 0, 1),
    (2560, 4096, 16): (16, 64, 4, 4, 4, 1, 0, 1, 0, 1, 3, 1, 1),
    (2560, 4096, 32): (32, 64, 7, 4, 3, 1, 0, 1, 0, 1, 2, 1, 1),
    (2560, 4096, 64): (64, 32, 4, 4, 4, 0, 0, 1, 0, 1, 2, 1, 1),
    (2560, 4096, 128): (64, 64, 4, 4, 4, 0, 1, 0, 1, 0, 0, 0, 0),
    (2560, 9728, 1): (16, 64, 7, 4, 3, 1, 0, 1, 0, 1, 2, 0, 0),
    (2560, 9728, 2): (16, 64, 7, 4, 3, 1, 0, 1, 0, 1, 2, 0, 1),
    (2560, 9728, 4): (16, 64, 7, 4, 3, 1, 0, 1, 0, 1, 2, 0, 1),
    (2560, 9728, 8): (16, 64, 7, 4, 4, 1, 0, 1, 0, 1, 2, 0, 1),
    (2560, 9728, 16): (16, 64, 5, 4, 4, 1, 0, 1, 0, 1, 3, 1, 1),
    (2560, 9728, 32): (32, 64, 7, 4, 3, 1, 0, 1, 0, 1, 2, 1, 1),
    (2560, 9728, 64): (64, 64, 7, 4, 4, 0, 0, 1, 0, 1, 2, 1, 1),
    (2560, 9728, 128): (64, 64, 4, 4, 4, 0, 1, 0, 1, 0, 0, 0, 0),
    (6144, 2560, 1): (16, 64, 3, 4, 3, 1, 0, 1, 0, 1, 2, 0, 0),
    (6144, 2560, 2): (16, 64, 3, 4, 3, 1, 0, 1, 0, 1, 2, 0, 1),
    (6144, 2560, 4): (16, 64, 3, 4, 3, 1, 0, 1, 0, 1, 2, 0, 1),
    (6144, 2560, 8): (16, 64, 3, 4, 4, 1, 0, 1, 0, 1, 2, 0, 1),
    (6144, 2560, 16): (16, 64, 3, 4, 4, 1, 0, 1, 0, 1, 3, 1, 1),
    (6144, 2560, 32): (32, 64, 3, 4, 3, 1, 0, 1, 0, 1, 2, 1, 1),
    (6144, 2560, 64): (64, 32, 2, 4, 4, 0, 0, 1, 0, 1, 2, 1, 1),
    (6144, 2560, 128): (64, 64, 2, 4, 4, 0, 1, 0, 1, 0, 0, 0, 0),
    (19456, 2560, 1): (16, 64, 1, 4, 3, 1, 0, 1, 0, 1, 2, 0, 0),
    (19456, 2560, 2): (16, 64, 1, 4, 3, 1, 0, 1, 0, 1, 2, 0, 1),
    (19456, 2560, 4): (16, 64, 1, 4, 3, 1, 0, 1, 0, 1, 2, 0, 1),
    (19456, 2560, 8): (16, 64, 1, 4, 4, 1, 0, 1, 0, 1, 2, 0, 1),
    (19456, 2560, 16): (16, 64, 1, 4, 4, 1, 0, 1, 0, 1, 3, 1, 1),
    (19456, 2560, 32): (32, 64, 2, 4, 3, 1, 0, 1, 0, 1, 2, 1, 1),
    (19456, 2560, 64): (64, 64, 1, 4, 4, 0, 0, 0, 0, 1, 2, 1, 1),
    (19456, 2560, 128): (64, 64, 1, 4, 4, 0, 1, 0, 1, 0, 0, 0, 0),
}
VARIANT_TABLE = {
    (2560, 4096, 64): "w8a8",
    (2560, 4096, 128): "w8a8",
    (2560, 4096, 256): "w8a8",
    (2560, 4096, 1024): "scaled_mm",
    (2560, 4096, 1073741824): "scaled_mm",
    (2560, 9728, 64): "w8a8",
    (2560, 9728, 128): "w8a8",
    (2560, 9728, 256): "w8a8",
    (2560, 9728, 1024): "scaled_mm",
    (2560, 9728, 1073741824): "scaled_mm",
    (6144, 2560, 64): "w8a8",
    (6144, 2560, 128): "w8a8",
    (6144, 2560, 256): "w8a8",
    (6144, 2560, 1024): "scaled_mm",
    (6144, 2560, 1073741824): "scaled_mm",
    (19456, 2560, 64): "w8a8",
    (19456, 2560, 128): "w8a8",
    (19456, 2560, 256): "w8a8",
    (19456, 2560, 1024): "scaled_mm",
    (19456, 2560, 1073741824): "scaled_mm",
}


def test_tables_hold_the_configs_of_before() -> None:
    for loaded, expected in (
        (attention.TUNED_DECODE_CONFIGS, TUNED_DECODE_CONFIGS),
        (attention.TUNED_DECODE_CONFIGS_FP8_KV, TUNED_DECODE_CONFIGS_FP8_KV),
        (fp8_gemm.TUNED_CONFIGS, TUNED_CONFIGS),
        (fp8_gemm.TUNED_CONFIGS_FP8, TUNED_CONFIGS_FP8),
    ):
        assert {key: dataclasses.astuple(config) for key, config in loaded.items()} == expected
    assert dict(fp8_weights.VARIANT_TABLE) == VARIANT_TABLE


def test_tables_are_read_only() -> None:
    for table in (attention.TUNED_DECODE_CONFIGS, fp8_gemm.TUNED_CONFIGS_FP8, fp8_weights.VARIANT_TABLE):
        try:
            table[0] = None  # type: ignore[index]
        except TypeError:
            continue
        raise AssertionError("a tuned table accepted an assignment")


def test_decode_table_writer_merges_winners(tmp_path: Path) -> None:
    winner = AttentionConfig(num_warps=8, target_programs=528, min_split_tokens=64)
    timings = [{winner: 1.0, attention.DEFAULT_CONFIG: 2.0}, {winner: 3.0, attention.DEFAULT_CONFIG: 2.9}]
    winners = per_batch_winners({16: timings})
    assert winners == {16: winner}
    path = attention.write_decode_table(winners, directory=tmp_path)
    written = json.loads(path.read_text())
    assert written["bf16"]["16"] == {"num_warps": 8, "target_programs": 528, "min_split_tokens": 64}
    shipped = tuned.read_table(tuned.ATTENTION_DECODE)
    assert written["fp8_kv"] == shipped["fp8_kv"]
    assert {k: v for k, v in written["bf16"].items() if k != "16"} == {
        k: v for k, v in shipped["bf16"].items() if k != "16"
    }
    # a second write reads the first one back and adds to it
    attention.write_decode_table({2: attention.DEFAULT_CONFIG}, kv_fp8=True, directory=tmp_path)
    again = json.loads(path.read_text())
    assert again["bf16"]["16"] == written["bf16"]["16"] and again["fp8_kv"]["2"] == {}
    assert list(again["fp8_kv"]) == ["1", "2", "16", "64"]


def test_gemm_table_writer_merges_winners(tmp_path: Path) -> None:
    new = GemmConfig(32, 64, 5, num_stages=6, swap_ab=True)
    path = fp8_gemm.write_tuned_table({(2560, 9728, 16): new, (7, 128, 1): new}, True, directory=tmp_path)
    text = path.read_text()
    assert '{"n": 7, "k": 128, "m": 1, "block_m": 32, "block_n": 64, "split_k": 5, "num_stages": 6, ' in text
    written = json.loads(text)
    shipped = tuned.read_table(tuned.FP8_GEMM)
    assert written["w8a16"] == shipped["w8a16"]
    by_key = {(e["n"], e["k"], e["m"]): e for e in written["w8a8"]}
    assert len(by_key) == len(shipped["w8a8"]) + 1
    entry = dict(by_key[(2560, 9728, 16)])
    assert GemmConfig(**{k: v for k, v in entry.items() if k not in ("n", "k", "m")}) == new
    assert by_key[(6144, 2560, 1)] == next(
        e for e in shipped["w8a8"] if (e["n"], e["k"], e["m"]) == (6144, 2560, 1)
    )


def test_variant_table_writer_takes_sweep_rows(tmp_path: Path) -> None:
    rows = [
        {"shape": "qkv", "n": 6144, "k": 2560, "m": 3, "us": {}, "best": "w8a16"},
        {"shape": "o", "n": 2560, "k": 4096, "m": 2048, "us": {}, "best": "bf16"},
    ]
    winners = sweep_winners(rows)
    assert winners == {(6144, 2560, 4): "w8a16", (2560, 4096, fp8_weights.LARGE_M): "bf16"}
    path = fp8_weights.write_variant_table(winners, directory=tmp_path)
    written = {(e["n"], e["k"], e["m"]): e["variant"] for e in json.loads(path.read_text())}
    assert written == {**fp8_weights.VARIANT_TABLE, **winners}


def test_package_data_ships_the_tables() -> None:
    root = Path(__file__).resolve().parents[1]
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {path for pattern in package_data["shoal"] for path in (root / "shoal").glob(pattern)}
    for name in (tuned.ATTENTION_DECODE, tuned.FP8_GEMM, tuned.FP8_VARIANTS):
        assert tuned.TABLE_DIR / name in shipped
