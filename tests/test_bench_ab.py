"""`shoal bench ab` on the CPU: variant parsing, tables changed and restored, the timing order,
the split-K workspace check; the timing itself needs a GPU."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from shoal.bench import ab
from shoal.kernels.attention import TUNED_DECODE_CONFIGS
from shoal.kernels.fp8_gemm import TUNED_CONFIGS_FP8, SplitKWorkspace
from shoal.tuning import TUNING

DOWN_64 = (2560, 9728, 64)


def test_parse_variant() -> None:
    changes = ab.parse_variant("attention@16:block_n=128,fused_merge=False+gemm@2560x9728x64:split_k=4")
    assert changes == [
        ab.Change("attention", 16, {"block_n": 128, "fused_merge": False}),
        ab.Change("gemm", DOWN_64, {"split_k": 4}),
    ]
    for bad in ("attention:block_n=1", "cache@1:x=1", "gemm@2560x9728:split_k=4", "attention@1:block_n=big"):
        with pytest.raises(ValueError, match="bad variant part"):
            ab.parse_variant(bad)


def test_variant_replaces_table_entries_and_leaves_the_tables_alone() -> None:
    attention, gemm = TUNED_DECODE_CONFIGS[16], TUNED_CONFIGS_FP8[DOWN_64]
    tuning = ab.variant(TUNING, ab.parse_variant("attention@16:num_stages=4+gemm@2560x9728x64:split_k=4"))
    changed = tuning.attention_configs[16]
    assert changed.num_stages == 4 and changed.block_n == attention.block_n
    assert tuning.gemm_configs[DOWN_64].split_k == 4 and tuning.gemm_configs[DOWN_64].block_n == gemm.block_n
    assert TUNED_DECODE_CONFIGS[16] is attention and TUNED_CONFIGS_FP8[DOWN_64] is gemm
    assert not TUNING.attention_configs and not TUNING.gemm_configs
    with pytest.raises(TypeError):  # not a field
        ab.variant(TUNING, ab.parse_variant("attention@16:num_stages=4+gemm@2560x9728x64:nonsense=1"))
    with pytest.raises(KeyError, match="no entry"):
        ab.variant(TUNING, ab.parse_variant("gemm@1x2x3:split_k=1"))


def test_step_and_kernel_switches_are_set_and_restored() -> None:
    """`step:` and `kernel:` changes give the step a variant of its tuning for the variant only
    (also when a later change of the same variant fails); unknown names are refused."""
    changes = ab.concrete(ab.parse_variant("step:head_kernel_max_rows=16,two_launch_fast_to=64"))
    assert changes == [ab.Change("step", None, {"head_kernel_max_rows": 16, "two_launch_fast_to": 64})]
    changes += ab.parse_variant("kernel:packed_pairs=false,words_min_rows=9+step:max_top_k=16")
    step = SimpleNamespace(tuning=TUNING, max_top_k=32)
    with ab.applied(changes, step):
        t = step.tuning
        assert (t.head_kernel_max_rows, t.two_launch_fast_to, t.packed_pairs, t.words_min_rows) == (
            16,
            64,
            False,
            9,
        )
        assert step.max_top_k == 16
    assert step.tuning is TUNING and step.max_top_k == 32
    with pytest.raises(KeyError):
        with ab.applied(ab.parse_variant("step:head_kernel_max_rows=16+gemm@1x2x3:split_k=1"), step):
            pass
    assert step.tuning is TUNING
    with pytest.raises(ValueError, match="step switches are"):
        ab.parse_variant("step:max_batch=3")
    with pytest.raises(ValueError, match="kernel switches are"):
        ab.parse_variant("kernel:PACKED_PAIRS=false")


def test_every_switch_is_read_by_the_step(golden_dir) -> None:
    """Every `step:` switch is a field of the step's tuning (or `max_top_k`), so a variant cannot
    set an attribute nothing reads."""
    import torch

    from shoal.config import EngineConfig
    from shoal.engine.core import EngineCore
    from shoal.engine.decode_step import DecodeStep
    from shoal.models import load_model

    model = load_model(golden_dir / "s2_tiny", device="cpu", dtype=torch.float32)
    runner = EngineCore(model, EngineConfig(device="cpu", dtype="float32", num_pages=16)).runner
    step = DecodeStep(model, runner.kv, runner.max_batch, use_kernels=True)  # the engine's on a GPU
    for name in ab.STEP_SWITCHES:
        assert hasattr(step.tuning, name) or hasattr(step, name), name


def test_wildcard_gemm_keys_expand_to_the_matching_entries() -> None:
    changes = ab.concrete(ab.parse_variant("gemm@*x*x1:scales_ahead=true+attention@16:block_n=128"))
    ones = sorted(key for key in TUNED_CONFIGS_FP8 if key[2] == 1)
    assert len(ones) == 4 and sorted(c.key for c in changes if c.table == "gemm") == ones
    assert all(c.fields == {"scales_ahead": True} for c in changes if c.table == "gemm")
    assert ab.Change("attention", 16, {"block_n": 128}) in changes
    everything = ab.concrete(ab.parse_variant("gemm@*x*x*:scales_ahead=true"))
    assert len(everything) == len(TUNED_CONFIGS_FP8)
    assert [c.key for c in ab.concrete(ab.parse_variant("gemm@2560x*x64:split_k=4"))] == [
        key for key in TUNED_CONFIGS_FP8 if key[0] == 2560 and key[2] == 64
    ]
    with pytest.raises(KeyError, match="no entry matching"):
        ab.concrete(ab.parse_variant("gemm@*x*x3:split_k=1"))


def test_interleaved_order() -> None:
    assert ab.interleaved(["base", "a", "b"], 2) == ["base", "a", "b", "base", "a", "b"]


def test_workspace_shortfall() -> None:
    core = SimpleNamespace(runner=SimpleNamespace(step=SimpleNamespace(fp8=SimpleNamespace(workspace=None))))
    assert ab.workspace_shortfall(core, ab.parse_variant("gemm@2560x9728x64:split_k=16"), 64) is None
    need, tiles = SplitKWorkspace.required(64, 2560, TUNED_CONFIGS_FP8[DOWN_64])
    core.runner.step.fp8.workspace = SplitKWorkspace(need, tiles, "cpu")
    assert ab.workspace_shortfall(core, ab.parse_variant("gemm@2560x9728x64:split_k=4"), 64) is None
    assert "needs" in ab.workspace_shortfall(core, ab.parse_variant("gemm@2560x9728x64:split_k=16"), 64)
    # batch 16 never launches the M = 64 bucket (its row counts are 16 and 32)
    assert ab.workspace_shortfall(core, ab.parse_variant("gemm@2560x9728x64:split_k=16"), 16) is None
    assert ab.workspace_shortfall(core, ab.parse_variant("attention@64:block_n=32"), 64) is None


def test_print_table(capsys: pytest.CaptureFixture[str]) -> None:
    ab.print_table({16: {"base": [5.0, 5.2, 5.1], "attention@16:num_stages=4": [4.9, 4.8, 5.0], "x": []}})
    out = capsys.readouterr().out
    assert "batch 16" in out and "5.100 (1.000)" in out and "4.900 (0.961)" in out and " x " not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_run_without_a_gpu_refuses_and_checks_variants_first() -> None:
    parser = argparse.ArgumentParser()
    ab.add_arguments(parser)
    with pytest.raises(ValueError, match="bad variant part"):
        ab.run(parser.parse_args(["--variant", "attention@x:block_n=1"]))
    assert ab.run(parser.parse_args(["--variant", "attention@16:block_n=128"])) == 2
