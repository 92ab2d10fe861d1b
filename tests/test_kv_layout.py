"""`EngineConfig.kv_layout="head_major"`: the KV pool stored `[page, kv head, token, dim]` and
handed to every consumer as the usual `[page, token, kv head, dim]` view. The kernels address the
pool through its strides, so every one of them must compute exactly what it computes on the
token-major pool (Triton's interpreter on the CPU), and the engine must produce the same frames."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
from model_testing import first_frame_core, staggered_request_frames, tiny_s2  # noqa: E402
from prefill_testing import prefill_tokens, prefill_two_prompts  # noqa: E402

from shoal.config import EngineConfig  # noqa: E402
from shoal.engine.engine import EngineCore  # noqa: E402
from shoal.engine.kv_cache import PagedKV, new_pool, to_head_major  # noqa: E402
from shoal.kernels.attention import (  # noqa: E402
    AttentionConfig,
    paged_decode_attention,
    paged_prefill_attention,
    shared_prefix_decode_attention,
)
from shoal.kernels.norm_rope import qk_norm_rope_kv_write  # noqa: E402
from shoal.models.layers import rope_table  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = AttentionConfig(block_n=16, block_m=4, prefix_block_rows=16, prefix_splits=2)


head_major = to_head_major


def test_new_pool_is_the_token_major_view_of_head_major_memory() -> None:
    pool = new_pool((3, 5, 4, 2, 8), torch.bfloat16, "cpu", head_major=True)
    assert pool.shape == (3, 5, 4, 2, 8) and not pool.is_contiguous()
    assert pool.stride()[-3:] == (8, 4 * 8, 1)  # token stride = dim, head stride = page_size x dim
    assert new_pool((3, 5, 4, 2, 8), torch.bfloat16, "cpu").is_contiguous()
    values = torch.randn(5, 4, 2, 8)
    converted = to_head_major(values)
    assert torch.equal(converted, values) and converted.stride() == pool.stride()[1:]


def test_config_and_pool_refuse_what_the_layout_cannot_hold() -> None:
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        EngineConfig(kv_layout="page_major")
    with pytest.raises(ValueError, match="model-dtype caches only"):
        EngineConfig(kv_layout="head_major", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="model dtype only"):
        PagedKV(1, 4, 4, 2, 8, torch.float32, "cpu", kv_dtype=torch.float8_e4m3fn, head_major=True)


def _paged_case(seq_lens: list[int], hkv: int, d: int, page: int, shared_pages: int = 0, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page) for n in seq_lens]
    num_pages = shared_pages + sum(p - shared_pages for p in pages_per_seq) + 2
    order = torch.randperm(num_pages, generator=generator)
    tables = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32)
    cursor = shared_pages
    for b, count in enumerate(pages_per_seq):
        tables[b, :shared_pages] = order[:shared_pages]
        tables[b, shared_pages:count] = order[cursor : cursor + count - shared_pages]
        cursor += count - shared_pages
    k = torch.randn(num_pages, page, hkv, d, generator=generator).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(num_pages, page, hkv, d, generator=generator).to(torch.bfloat16).to(DEVICE)
    return k, v, tables.to(DEVICE), generator


@pytest.mark.interpreter
@pytest.mark.parametrize("num_splits,fused", [(1, False), (3, False), (3, True)], ids=["1", "3", "3-fused"])
def test_decode_attention_gives_the_same_bits_on_both_layouts(num_splits: int, fused: bool) -> None:
    seq_lens = [1, 17, 40]
    k, v, tables, generator = _paged_case(seq_lens, 2, 32, 16)
    q = torch.randn(len(seq_lens), 8, 32, generator=generator).to(torch.bfloat16).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    config = replace(SMALL, fused_merge=fused)
    token = paged_decode_attention(q, k, v, tables, lens, num_splits=num_splits, config=config)
    head = paged_decode_attention(
        q, head_major(k), head_major(v), tables, lens, num_splits=num_splits, config=config
    )
    assert torch.equal(head, token)


@pytest.mark.interpreter
def test_prefill_attention_gives_the_same_bits_on_both_layouts() -> None:
    seq_lens, new_tokens = [9, 21], [5, 21]  # the first continues after 4 cached tokens
    k, v, tables, generator = _paged_case(seq_lens, 2, 32, 4, seed=1)
    q = torch.randn(sum(new_tokens), 4, 32, generator=generator).to(torch.bfloat16).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 5, 26], dtype=torch.int32, device=DEVICE)
    token = paged_prefill_attention(q, k, v, tables, lens, starts, max(new_tokens), config=SMALL)
    head = paged_prefill_attention(q, head_major(k), head_major(v), tables, lens, starts, 21, config=SMALL)
    assert torch.equal(head, token)


@pytest.mark.interpreter
def test_shared_prefix_attention_gives_the_same_bits_on_both_layouts() -> None:
    seq_lens = [40, 37, 45]
    k, v, tables, generator = _paged_case(seq_lens, 2, 32, 16, shared_pages=2, seed=2)
    q = torch.randn(3, 4, 32, generator=generator).to(torch.bfloat16).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    prefix = torch.full((3,), 32, dtype=torch.int32, device=DEVICE)
    groups = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    args = (tables, lens, prefix, groups, 3)
    token = shared_prefix_decode_attention(q, k, v, *args, num_splits=2, config=SMALL)
    head = shared_prefix_decode_attention(q, head_major(k), head_major(v), *args, num_splits=2, config=SMALL)
    assert torch.equal(head, token)


@pytest.mark.interpreter
@pytest.mark.parametrize("build", ["per_head", "block"])
def test_kv_write_fills_both_layouts_alike(build: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.kernels import norm_rope

    monkeypatch.setattr(norm_rope, "BLOCK_KERNEL_FROM_TOKENS", 1 << 30 if build == "per_head" else 1)
    generator = torch.Generator().manual_seed(3)
    tokens, hq, hkv, d, page, num_pages = 9, 4, 2, 32, 4, 5
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=generator) * 3).to(torch.bfloat16).to(DEVICE)
    positions = torch.randint(0, 200, (tokens,), generator=generator).to(DEVICE)
    table = rope_table(256, d, 1e6).to(DEVICE)
    weights = [torch.randn(d, generator=generator).to(torch.bfloat16).to(DEVICE) for _ in range(2)]
    slots = torch.randperm(num_pages * page, generator=generator)[:tokens].to(DEVICE)
    pools = {}
    for layout in ("token", "head"):
        k = torch.zeros(num_pages, page, hkv, d, dtype=torch.bfloat16, device=DEVICE)
        k, v = (head_major(k), head_major(k.clone())) if layout == "head" else (k, k.clone())
        q = qk_norm_rope_kv_write(qkv, positions, table, k, v, slots, hq, hkv, *weights, eps=1e-6)
        pools[layout] = (q, k, v)
    for token_major, head_major_ in zip(pools["token"], pools["head"], strict=True):
        assert torch.equal(head_major_, token_major)
    assert pools["token"][1].abs().sum() > 0  # something was written


@pytest.mark.interpreter
def test_fused_prefill_writes_the_same_cache_in_both_layouts(golden_dir) -> None:
    """The fused-kernel prefill (`DecodeStep.prefill`) of two prompts, one continuing after a cached
    chunk, into a token-major and a head-major `PagedKV`."""
    model = tiny_s2(golden_dir, torch.float32)
    mc = model.config
    tokens = prefill_tokens(mc)
    results = []
    for head in (False, True):
        kv = PagedKV(mc.n_layer, 8, 4, mc.n_local_heads, mc.head_dim, torch.float32, "cpu", head_major=head)
        hidden, normed = prefill_two_prompts(model, kv, tokens, fused=True)
        results.append((hidden, normed, kv.k[:, :7].clone(), kv.v[:, :7].clone()))
    for head_value, token_value in zip(results[1], results[0], strict=True):
        assert torch.equal(head_value, token_value)


@pytest.mark.parametrize("decode_step", ["reference", "fast"])
def test_engine_frames_do_not_depend_on_the_layout(golden_dir, decode_step: str) -> None:
    """Staggered requests (prefill and decode sharing steps at changing batch sizes) through the
    torch paths on the CPU: the pool's writes (`PagedKV._store`) and reads go through the view."""
    model = tiny_s2(golden_dir, torch.float32)
    frames = {}
    for layout in ("token_major", "head_major"):
        config = EngineConfig(
            device="cpu", dtype="float32", num_pages=64, page_size=16, decode_step=decode_step,
            kv_layout=layout, ignore_eos=True,
        )  # fmt: skip
        core = EngineCore(model, config)
        assert core.runner.kv.k.is_contiguous() == (layout == "token_major")
        frames[layout] = staggered_request_frames(core, seed=4)
    assert len(frames["head_major"]) == len(frames["token_major"]) == 7
    for token_major, head_major_ in zip(frames["token_major"], frames["head_major"], strict=True):
        assert torch.equal(head_major_, token_major)


def _bench_row(layout: str, step_ms: float, aggregate: float) -> dict:
    return {
        "weight_format": "fp8", "kv_cache_dtype": "auto", "kv_layout": layout, "concurrency": 16,
        "shared_prefix": 0, "max_prefill_tokens": 8192, "aggregate_frames_per_s": aggregate,
        "per_request_frames_per_s": aggregate / 16, "ttff_p50_ms": 50.0, "decode_step_ms": step_ms,
    }  # fmt: skip


def test_bench_compares_the_layouts_and_gates_only_the_token_major_rows() -> None:
    from shoal.bench import gate_performance
    from shoal.bench.engine import kv_label, ratio_lines

    rows = [_bench_row("token_major", 3.5, 3600.0), _bench_row("head_major", 3.43, 3672.0)]
    assert ratio_lines(rows) == [
        "kv head-major/token-major fp8 conc 16 prefix 0: aggregate 1.020x, decode step 1.020x faster"
    ]
    assert gate_performance.select_results(rows, "fp8") == rows[:1]
    assert [kv_label(r) for r in rows] == ["auto", "auto+hm"]


@pytest.mark.gpu
@pytest.mark.parametrize("weight_format", ["bf16", "fp8"])
def test_engine_frames_do_not_depend_on_the_layout_gpu(golden_dir, weight_format: str) -> None:
    """The same through the CUDA graphs and the kernels (decode, prefill graphs, first frames)."""
    frames = {}
    for layout in ("token_major", "head_major"):
        core = first_frame_core(golden_dir, weight_format, None, kv_layout=layout, ignore_eos=True)
        assert core.runner.kv.k.is_contiguous() == (layout == "token_major")
        frames[layout] = staggered_request_frames(core, seed=11)
        del core
        torch.cuda.empty_cache()
    assert len(frames["head_major"]) == len(frames["token_major"]) == 7
    for token_major, head_major_ in zip(frames["token_major"], frames["head_major"], strict=True):
        assert torch.equal(head_major_, token_major)
