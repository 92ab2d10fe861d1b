"""`shoal bench engine`: decode throughput and time to first frame of the batching engine.

Without `--checkpoint` the model is S2-Pro-shaped (the full-size config) with random weights
built directly on the GPU: no file, no tokenizer. Prompts are `--prompt-tokens` long, either
all different or sharing a voice prefix (`--shared-prefix` tokens). Output length is fixed
(`ignore_eos`). Per concurrency it reports aggregate frames/s, per-request decode frames/s,
time to first frame (p50/p95) and peak GPU memory, plus a naive batch-1 loop
(`models.reference.generate`) on the same model for comparison. These whole-request numbers
include prefill, scheduling and host jitter and moved by about 10% between identical runs, so
each row also carries the decode step alone at batch = concurrency, timed as CUDA-graph replays
(`bench/timing.py`) on synthetic rows of `--step-context` keys (default prompt + frames / 2): it
repeats within 0.3%, and the performance gate (`bench/gate_performance.py`) compares it. `--json FILE` writes
the rows, the sweep and the run's environment (GPU, torch/triton, date, commit, command), which
`shoal gate performance --results FILE [--write-baseline]` reads.

`--weight-format bf16 fp8` runs both engines in one call, one after the other on the same random
weights (FP8: quantized at engine start, `engine/fp8_weights.py`), prints fp8/bf16 ratios and checks
the issue's targets (`bench/targets.py: TARGETS`). `--fp8-sweep` times every FP8 projection variant
per S2-Pro GEMM shape and M as CUDA-graph replays and prints `VARIANT_TABLE` entries to paste.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import gc
import itertools
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from shoal.bench.targets import check_targets, select_results
from shoal.bench.timing import time_graph_ms
from shoal.config import KV_CACHE_DTYPES, EngineConfig
from shoal.engine.api import FinishReason
from shoal.engine.engine import EngineCore
from shoal.engine.request import SamplingParams
from shoal.tuning import environment as environment_setting

S2_PRO_CONFIG = {
    "model_type": "fish_qwen3_omni",
    "eos_token_id": 151645,
    "semantic_start_token_id": 151678,
    "semantic_end_token_id": 155773,
    "text_config": {
        "dim": 2560, "n_layer": 36, "n_head": 32, "n_local_heads": 8, "head_dim": 128,
        "intermediate_size": 9728, "max_seq_len": 32768, "rope_base": 1000000, "norm_eps": 1e-6,
        "vocab_size": 155776, "attention_qk_norm": True, "tie_word_embeddings": True,
    },
    "audio_decoder_config": {
        "dim": 2560, "n_layer": 4, "n_head": 32, "n_local_heads": 8, "head_dim": 128,
        "intermediate_size": 9728, "max_seq_len": 11, "num_codebooks": 10, "vocab_size": 4096,
        "rope_base": 1000000, "norm_eps": 1e-6, "attention_qk_norm": False,
    },
}  # fmt: skip


def build_random_s2(device: str, dtype: torch.dtype, seed: int = 0, slow_layers: int | None = None):
    """The full-size S2-Pro module tree with random weights, allocated on `device` directly;
    `slow_layers`: that many slow transformer layers instead of 36 (S2-Pro's shapes, less time)."""
    from shoal.models.config import parse_config
    from shoal.models.dual_ar import DualARTransformer

    fields = copy.deepcopy(S2_PRO_CONFIG)
    if slow_layers is not None:
        fields["text_config"]["n_layer"] = slow_layers
    config = parse_config(fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = DualARTransformer(config).to(dtype)
        for param in model.parameters():
            if param.dim() >= 2:  # keep activations in a sane range at this width
                torch.nn.init.normal_(param, std=0.02)
        model.build_rope_tables(device)
    return model.eval()


# Block tables this many keys wider than the timed step's context: the width `run_engine_bench`
# gives its default step (300-token prompts + 64 frames + 16, timed at 300 + 32 keys), so tools
# timing the step alone (`shoal bench profile`, `shoal bench ab`) time the gate's step.
STEP_TABLE_MARGIN = 48


def random_step_core(
    batches: list[int], context: int, weight_format: str = "fp8", max_seq_len: int | None = None,
    kv_cache_dtype: str = "auto",
) -> EngineCore:  # fmt: skip
    """An engine on random S2-Pro weights with decode graphs for exactly `batches`, sized to time
    the step at `context` keys (`decode_step_ms`); `max_seq_len` overrides the table width."""
    model = build_random_s2("cuda", torch.bfloat16)
    config = EngineConfig(
        max_running_requests=max(batches), max_seq_len=max_seq_len or context + STEP_TABLE_MARGIN,
        memory_fraction=0.5, ignore_eos=True, weight_format=weight_format,
        graph_buckets=tuple(sorted(set(batches))), kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    return EngineCore(model, config)


def make_prompts(model, count: int, length: int, shared: int, seed: int) -> list[torch.Tensor]:
    """Random text-token prompts [N+1, length]; the first `shared` columns (a voice prefix with
    semantic frames) identical across prompts."""
    c = model.config
    g = torch.Generator().manual_seed(seed)

    def columns(n: int) -> torch.Tensor:
        block = torch.zeros(c.num_codebooks + 1, n, dtype=torch.long)
        block[0] = torch.randint(0, min(150_000, c.semantic_begin_id), (n,), generator=g)
        semantic = slice(n // 4, n // 2)  # a run of reference frames
        codes = torch.randint(
            0, c.codebook_size, (c.num_codebooks, semantic.stop - semantic.start), generator=g
        )
        block[1:, semantic] = codes
        block[0, semantic] = c.semantic_begin_id + codes[0]
        return block

    prefix = columns(shared) if shared else None
    return [
        torch.cat([prefix, columns(length - shared)], dim=1) if prefix is not None else columns(length)
        for _ in range(count)
    ]


def run_level(core: EngineCore, prompts: list[torch.Tensor], frames: int, prefix_len: int) -> dict:
    """Submit all prompts at once and run the engine until they are done."""
    return run_closed_loop(core, prompts, frames, len(prompts), prefix_len)


def run_closed_loop(
    core: EngineCore, prompts: list[torch.Tensor], frames: int, concurrency: int, prefix_len: int
) -> dict:
    """Keep up to `concurrency` requests running until every prompt is done, submitting at most
    one new prompt per step (so that requests of one length start, and finish, one step apart,
    instead of in waves); with `concurrency` = len(prompts), all are submitted at once. Staggered
    arrivals put prefill and decode in the same steps, as steady serving does."""
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    start = time.perf_counter()
    waiting = list(enumerate(prompts))
    requests = []

    def submit() -> None:
        i, prompt = waiting.pop(0)
        params = SamplingParams(seed=i)
        request = core.new_request(prompt, params, max_new_frames=frames, prefix_len=prefix_len)
        request.arrival_perf = time.perf_counter()
        core.add(request)
        requests.append(request)

    at_once = concurrency >= len(prompts)
    for _ in range(len(prompts) if at_once else 1):
        submit()
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    while core.has_work:
        for request in core.step():
            now = time.perf_counter()
            first.setdefault(id(request), now)
            if request.finish_reason is not None:
                done[id(request)] = now
        if waiting and len(requests) - len(done) < concurrency:
            submit()
    wall = time.perf_counter() - start
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)
    ttff = sorted(first[id(r)] - r.arrival_perf for r in requests)
    rates = [(frames - 1) / max(done[id(r)] - first[id(r)], 1e-9) for r in requests]
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "frames": frames,
        "aggregate_frames_per_s": len(prompts) * frames / wall,
        "per_request_frames_per_s": statistics.mean(rates),
        "ttff_p50_ms": 1000 * statistics.median(ttff),
        "ttff_p95_ms": 1000 * ttff[min(len(ttff) - 1, int(0.95 * len(ttff)))],
        "gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
        "wall_s": wall,
    }


def naive_batch1(model, prompt: torch.Tensor, frames: int) -> dict:
    """The oracle generation loop (eager, batch 1) on the same model: the baseline to beat.
    (It may stop early at a sampled `<|im_end|>`; the rate counts the frames it made.)"""
    from shoal.models.reference import generate

    generate(model, prompt, max_frames=4, temperature=0.8, top_p=0.8)  # warm up
    _sync()
    start = time.perf_counter()
    out = generate(model, prompt, max_frames=frames, temperature=0.8, top_p=0.8)
    _sync()
    return {"naive_batch1_frames_per_s": out.shape[1] / (time.perf_counter() - start)}


STEP_REPEATS = 50  # timed replays of the decode step per batch (the gate's number)
PART_REPEATS = 30  # timed replays per part of the breakdown and per FP8 sweep cell


def _fits(runner, batch: int, context: int) -> bool:
    """Synthetic rows of `context` keys in distinct pages fit the block tables and the pool."""
    pages_per_row = -(-context // runner.page_size)
    return (
        batch <= runner.max_batch
        and pages_per_row <= runner.max_pages
        and (batch + 1) * pages_per_row <= runner.kv.scratch_page
    )


def _synthetic_rows(core: EngineCore, batch: int, context: int):
    """The runner's decode buffers for `batch` rows, each at `context` keys in its own pages (the
    KV contents are whatever the pool holds: timing does not depend on them)."""
    runner = core.runner
    kv, page = runner.kv, runner.page_size
    pages_per_row = -(-context // page)
    view = runner.buffers.view(batch)
    rows = torch.arange(batch, device=runner.device)
    tables = (rows[:, None] * pages_per_row + torch.arange(pages_per_row, device=runner.device)).int()
    view.block_tables.fill_(kv.scratch_page)
    view.block_tables[:, :pages_per_row] = tables
    view.kv_lens.fill_(context)
    view.positions.fill_(context - 1)
    view.slots.copy_(tables[:, -1].long() * page + (context - 1) % page)
    view.frame_index.fill_(5)
    view.top_k.fill_(30)
    return view


@torch.no_grad()
def decode_step_ms(
    core: EngineCore, batches: list[int], context: int, repeats: int = STEP_REPEATS
) -> dict[int, float]:
    """{batch: ms of one whole decode step} as CUDA-graph replays on synthetic rows of `context`
    keys. This is what the performance gate compares: unlike whole-request rates (prefill,
    scheduling and host jitter: about 10% apart between identical runs) it repeats within 0.3%."""
    runner = core.runner
    result = {}
    for batch in batches:
        if _fits(runner, batch, context):
            view = _synthetic_rows(core, batch, context)
            with runner.step.holding_metadata():  # every replay at the same positions
                result[batch] = time_graph_ms(lambda view=view: runner.step(view), repeats=repeats)
    runner.host.invalidate()
    return result


@torch.no_grad()
def breakdown(core: EngineCore, batches: list[int], context: int) -> list[dict]:
    """Where a decode step's time goes: the whole step, the slow model alone, one layer's
    attention (Triton paged kernel vs SDPA over a gathered contiguous view), each timed as
    CUDA-graph replays on synthetic rows of `context` keys in distinct pages."""
    runner = core.runner
    with runner.step.holding_metadata():  # every replay at the same positions
        results = [_breakdown_one(core, batch, context) for batch in batches if _fits(runner, batch, context)]
    runner.host.invalidate()
    return results


def _breakdown_one(core: EngineCore, batch: int, context: int) -> dict:
    from shoal.kernels.attention import paged_decode_attention

    runner, step = core.runner, core.runner.step
    kv = runner.kv
    pages_per_row = -(-context // runner.page_size)
    view = _synthetic_rows(core, batch, context)
    full = time_graph_ms(lambda: step(view), repeats=PART_REPEATS)
    slow = time_graph_ms(lambda: step.slow(view), repeats=PART_REPEATS)
    q = torch.randn(batch, 32, 128, device=runner.device, dtype=runner.dtype)
    pools = kv.layer(0)
    triton_ms = time_graph_ms(
        lambda: paged_decode_attention(q, pools.k, pools.v, view.block_tables, view.kv_lens, **pools.scales),
        repeats=PART_REPEATS,
    )
    index = view.block_tables[:, :pages_per_row].long()

    def sdpa():  # over the model-dtype values (an FP8 cache's bytes, widened: a reference time)
        keys = pools.k[index].to(q.dtype).flatten(1, 2)[:, :context].transpose(1, 2)
        values = pools.v[index].to(q.dtype).flatten(1, 2)[:, :context].transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=True)

    sdpa_ms = time_graph_ms(sdpa, repeats=PART_REPEATS)
    return {
        "batch": batch, "step_ms": full, "slow_ms": slow, "head_fast_ms": full - slow,
        "attn_layer_triton_us": 1000 * triton_ms, "attn_layer_sdpa_gather_us": 1000 * sdpa_ms,
        "frames_per_s": 1000 * batch / full,
    }  # fmt: skip


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_engine_bench(
    checkpoint: str | None = None,
    concurrencies: list[int] | None = None,
    *,
    frames: int = 128,
    prompt_tokens: int = 300,
    shared_prefix: int = 0,
    device: str = "cuda",
    dtype: str = "bfloat16",
    use_cuda_graphs: bool = True,
    naive: bool = False,
    breakdown_batches: list[int] | None = None,
    weight_format: str = "bf16",
    step_timing: bool = True,
    step_context: int | None = None,
    ttff_samples: int = 7,
    max_seq_len: int | None = None,
    prefill_graphs: bool = True,
    prefill_graph_segments: int = EngineConfig.prefill_graph_segments,
    prefill_graph_buckets: tuple[int, ...] | None = None,
    kv_cache_dtype: str = "auto",
    closed_loop: int = 0,
    overlap_prefill: bool = True,
    max_prefill_tokens: tuple[int, ...] = (),
) -> list[dict]:
    """One result dict per concurrency. `closed_loop`: run that many requests per level, with
    `concurrency` of them running at any time (`run_closed_loop`), instead of `concurrency`
    requests submitted at once; `overlap_prefill`: `EngineConfig.overlap_prefill`;
    `max_prefill_tokens`: each concurrency once per value of `EngineConfig.max_prefill_tokens`
    (the step's prefill budget: how a wave's prompts are chunked), side by side on one engine
    (empty: the config's default only). With
    `step_timing` (on a GPU) each also carries the decode step at batch = concurrency timed as
    CUDA-graph replays at `step_context` keys (default `prompt_tokens + frames // 2`):
    `decode_step_ms`, `decode_step_context` and `decode_frames_per_s` = 1000 / step ms, the
    per-request rate the performance gate compares.
    At concurrency 1 the first-frame time is the median over the level's request and
    `ttff_samples` more single requests (p95 column: the worst of them). `max_seq_len` (default:
    just what the requests need) sizes the block tables, hence the decode attention's split count:
    `shoal serve` uses the model's (32,768 for S2-Pro), so pass that to measure its step."""
    concurrencies = concurrencies or [1, 4, 16, 64]
    torch_dtype = getattr(torch, dtype)
    if checkpoint:
        from shoal.models import load_model

        model = load_model(checkpoint, device=device, dtype=torch_dtype)
    else:
        model = build_random_s2(device, torch_dtype)
    config = EngineConfig(
        device=device,
        dtype=dtype,
        max_running_requests=max(concurrencies),
        max_seq_len=max_seq_len or max(prompt_tokens + frames, step_context or 0) + 16,
        memory_fraction=0.6,
        use_cuda_graphs=use_cuda_graphs,
        ignore_eos=True,
        weight_format=weight_format,
        prefill_graphs=None if prefill_graphs else False,
        prefill_graph_segments=prefill_graph_segments,
        kv_cache_dtype=kv_cache_dtype,
        overlap_prefill=overlap_prefill,
        **({"prefill_graph_buckets": tuple(prefill_graph_buckets)} if prefill_graph_buckets else {}),
    )
    core = EngineCore(model, config)  # weight_format="fp8" quantizes the model in place
    results = []
    # More prompts at once than the static prefill packs warm the eager prefill of several chunks
    # (its Triton kernels compile on first use): with prefill graphs a single request never runs
    # it, and the first level with concurrency > 1 would pay the compilation in its first frames.
    burst = make_prompts(model, prefill_graph_segments + 1, prompt_tokens, shared_prefix, seed=999)
    run_level(core, burst, 4, shared_prefix)
    budgets = max_prefill_tokens or (config.max_prefill_tokens,)
    for concurrency, budget in itertools.product(concurrencies, budgets):
        # The scheduler reads the budget from the shared config at every step.
        core.config.max_prefill_tokens = budget
        # All at once: `concurrency` prompts; closed loop: `closed_loop` (the first `concurrency`
        # of them the same prompts).
        count = closed_loop or concurrency
        prompts = make_prompts(model, count, prompt_tokens, shared_prefix, seed=concurrency)
        run_level(core, prompts[:1], 4, shared_prefix)  # warm the prefill path
        result = run_closed_loop(core, prompts, frames, concurrency, shared_prefix)
        if concurrency == 1 and ttff_samples:
            # One request gives one first-frame time: add single short requests (new prompts, so
            # nothing is cached) and report the median and the worst of all of them.
            samples = [result["ttff_p50_ms"]]
            for i in range(ttff_samples):
                extra = make_prompts(model, 1, prompt_tokens, shared_prefix, seed=1000 + i)
                samples.append(run_level(core, extra, 2, shared_prefix)["ttff_p50_ms"])
            result.update(
                ttff_samples_ms=samples, ttff_p50_ms=statistics.median(samples), ttff_p95_ms=max(samples)
            )
        result["shared_prefix"] = shared_prefix
        result["weight_format"] = weight_format
        result["kv_cache_dtype"] = kv_cache_dtype
        result["prompt_tokens"] = prompt_tokens
        result["max_seq_len"] = config.max_seq_len
        result["prefill_graphs"] = core.runner.prefill_graphs is not None
        result["prefill_graph_segments"] = prefill_graph_segments
        result["prefill_graph_buckets"] = list(config.prefill_graph_buckets)
        result["overlap_prefill"] = overlap_prefill  # the setting (it takes effect on CUDA with graphs)
        result["closed_loop"] = closed_loop
        result["max_prefill_tokens"] = budget
        results.append(result)
    graphs_possible = core.runner.step is not None and core.runner.device.type == "cuda"
    if step_timing and graphs_possible:
        context = step_context or prompt_tokens + frames // 2
        steps = decode_step_ms(core, concurrencies, context)
        for result in results:
            ms = steps.get(result["concurrency"])
            if ms is not None:
                result.update(decode_step_ms=ms, decode_step_context=context, decode_frames_per_s=1000 / ms)
    if breakdown_batches and graphs_possible:
        results[0]["breakdown"] = breakdown(core, breakdown_batches, prompt_tokens + frames // 2)
    if naive:
        results[0].update(naive_batch1(model, make_prompts(model, 1, prompt_tokens, 0, 0)[0], frames))
    return results


def free_gpu() -> None:
    """Return the previous engine's memory (its KV pool is sized from free memory)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def fp8_sweep(ms: list[int], device: str = "cuda") -> list[dict]:
    """µs per call of each FP8 projection variant for the S2-Pro GEMM shapes (block 0 of a random
    model), as CUDA-graph replays on reserved buffers: the numbers `VARIANT_TABLE` is filled from."""
    from shoal.engine.fp8_weights import VARIANTS, Fp8Projections, m_bucket, prepare_model

    model = build_random_s2(device, torch.bfloat16)
    prepare_model(model)
    projections = Fp8Projections(model, table={})
    block = projections.blocks[id(model.layers[0])]
    gate_up = ("gate_up", block.gate_up, False) if block.gate_up is not None else ("w1", block.w1, False)
    shapes = [("qkv", block.qkv, False), ("o", block.wo, False), gate_up, ("down+swiglu", block.w2, True)]
    for _, w, _ in shapes:
        if w.dense is None:
            from shoal.kernels.reference import dequantize_weight

            w.dense = dequantize_weight(w.q, w.scale).to(torch.bfloat16)
    projections.reserve(ms)
    rows = []
    for name, w, swiglu in shapes:
        for m in ms:
            x = torch.randn(m, 2 * w.k if swiglu else w.k, device=device, dtype=torch.bfloat16)
            timings = {}
            for variant in VARIANTS:
                projections.table.clear()
                projections.table[(w.n, w.k, m_bucket(m))] = variant
                call = functools.partial(projections._linear, w, x, swiglu=swiglu)
                timings[variant] = 1000 * time_graph_ms(call, repeats=PART_REPEATS)
            best = min(timings, key=timings.get)
            rows.append({"shape": name, "n": w.n, "k": w.k, "m": m, "us": timings, "best": best})
    return rows


def print_sweep(rows: list[dict]) -> None:
    from shoal.engine.fp8_weights import VARIANTS, m_bucket

    print(f"{'shape':>12} {'m':>5} " + " ".join(f"{v:>12}" for v in VARIANTS) + "  best")
    for r in rows:
        cells = " ".join(f"{r['us'][v]:>12.1f}" for v in VARIANTS)
        print(f"{r['shape']:>12} {r['m']:>5} {cells}  {r['best']}")
    print("VARIANT_TABLE entries (shoal/engine/fp8_weights.py):")
    for r in rows:
        key = f"({r['n']}, {r['k']}, {m_bucket(r['m'])})"
        print(f"    {key}: {r['best']!r},  # {r['shape']} {r['us'][r['best']]:.1f} us")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default=None, help="default: random S2-Pro-shaped weights")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--frames", type=int, default=128, help="frames per request (fixed)")
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--shared-prefix", type=int, nargs="+", default=[0, 200], help="voice prefix tokens")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--no-naive", action="store_true", help="skip the naive batch-1 loop")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--breakdown", type=int, nargs="*", default=[1, 64], help="batches timed part by part (graphs)"
    )
    parser.add_argument(
        "--step-context",
        type=int,
        default=None,
        help="keys per row when timing the decode step at each concurrency (default prompt + frames/2)",
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="engine max_seq_len (block-table width; default prompt + frames + 16; shoal serve: the model's)",
    )
    parser.add_argument(
        "--prefill-graphs",
        choices=("off", "on"),
        default="on",
        help="prefill chunks as CUDA graphs (EngineConfig.prefill_graphs; on by default)",
    )
    parser.add_argument(
        "--prefill-graph-segments",
        type=int,
        default=EngineConfig.prefill_graph_segments,
        help="requests' chunks packed into one prefill replay (EngineConfig.prefill_graph_segments)",
    )
    parser.add_argument(
        "--prefill-graph-buckets",
        type=int,
        nargs="+",
        default=None,
        metavar="TOKENS",
        help="token buckets of the prefill graphs (EngineConfig.prefill_graph_buckets; e.g. up to 8192 "
        "with --prefill-graph-segments 32 puts a concurrency-64 wave's chunks on graphs too)",
    )
    parser.add_argument(
        "--closed-loop",
        type=int,
        default=0,
        metavar="REQUESTS",
        help="per level, run this many requests with up to `concurrency` of them running at any "
        "time (at most one new one per step) instead of `concurrency` submitted at once",
    )
    parser.add_argument(
        "--overlap-prefill",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="prefill graphs beside the decode on a stream of their own (EngineConfig.overlap_prefill); "
        "`on off`: side by side",
    )
    parser.add_argument(
        "--max-prefill-tokens",
        type=_positive_int,
        nargs="+",
        default=None,
        metavar="TOKENS",
        help="the step's prefill budget (EngineConfig.max_prefill_tokens), one or more: every "
        "concurrency once per value on the same engine (`8192 2048`: side by side)",
    )
    parser.add_argument(
        "--weight-format",
        nargs="+",
        choices=("bf16", "fp8"),
        default=["bf16"],
        help="one or more, run one after the other (`bf16 fp8`: ratios side by side)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=KV_CACHE_DTYPES,
        default=["auto"],
        help="KV cache storage, one or more (EngineConfig.kv_cache_dtype; `auto fp8`: side by side)",
    )
    parser.add_argument(
        "--fp8-sweep",
        type=int,
        nargs="*",
        default=None,
        metavar="M",
        help="first time every FP8 projection variant at these M (default 1 2 4 8 16 32 64 128 300 2048)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    sweep = None
    if args.fp8_sweep is not None:
        sweep = fp8_sweep(args.fp8_sweep or [1, 2, 4, 8, 16, 32, 64, 128, 300, 2048], args.device)
        free_gpu()
        print_sweep(sweep)
    all_results = []
    first_level = (args.shared_prefix[0], args.kv_cache_dtype[0])  # the naive loop runs once
    for weight_format, kv_cache_dtype, shared, overlap in itertools.product(
        args.weight_format, args.kv_cache_dtype, args.shared_prefix, args.overlap_prefill
    ):
        all_results += run_engine_bench(
            args.checkpoint,
            args.concurrency,
            frames=args.frames,
            prompt_tokens=args.prompt_tokens,
            shared_prefix=shared,
            device=args.device,
            dtype=args.dtype,
            use_cuda_graphs=not args.no_graphs,
            naive=not args.no_naive and (shared, kv_cache_dtype) == first_level,
            breakdown_batches=args.breakdown if shared == args.shared_prefix[0] else None,
            weight_format=weight_format,
            step_context=args.step_context,
            max_seq_len=args.max_seq_len,
            prefill_graphs=args.prefill_graphs == "on",
            prefill_graph_segments=args.prefill_graph_segments,
            prefill_graph_buckets=args.prefill_graph_buckets,
            kv_cache_dtype=kv_cache_dtype,
            closed_loop=args.closed_loop,
            overlap_prefill=overlap == "on",
            max_prefill_tokens=tuple(args.max_prefill_tokens or ()),
        )
        free_gpu()
    print_results(all_results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            document = {"results": all_results, "fp8_sweep": sweep, "environment": environment()}
            json.dump(document, f, indent=2)
    return 0


def environment(argv: list[str] | None = None) -> dict:
    """What a measurement ran on, stored beside its numbers (`--json`, the gate's baseline): step
    times only compare on the same GPU and software. `commit` comes from the COMMIT
    environment setting, else from the checkout's `.git` files (GPU machines get a copy without
    them: set it there)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": environment_setting("COMMIT") or _git_head(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "command": _command_line(sys.argv if argv is None else argv),
    }


def _command_line(argv: list[str]) -> str:
    """argv as a command to paste: `python -m shoal.cli ...` when run as a module of this package."""
    program = Path(argv[0]) if argv else Path("python")
    package = Path(__file__).resolve().parents[1]
    if program.suffix == ".py" and program.resolve().is_relative_to(package):
        relative = program.resolve().relative_to(package.parent).with_suffix("")
        head = ["python", "-m", ".".join(relative.parts)]
    else:
        head = [program.name]
    return shlex.join(head + list(argv[1:]))


def _git_head() -> str | None:
    """The checked-out commit, read from `.git` files (no git process); None when there is none."""
    git = Path(__file__).resolve().parents[2] / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: PATH"
            git = (git.parent / git.read_text().split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head[:12]
        ref = head.split(":", 1)[1].strip()
        ref_file = git / ref
        if ref_file.exists():
            return ref_file.read_text().strip()[:12]
        common = git / "commondir"
        root = (git / common.read_text().strip()).resolve() if common.exists() else git
        if (root / ref).exists():
            return (root / ref).read_text().strip()[:12]
        for line in (root / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0][:12]
    except (OSError, IndexError):
        return None
    return None


def print_results(all_results: list[dict]) -> None:
    header = (
        f"{'format':>6} {'kv':>4} {'conc':>5} {'prefix':>6} {'ovl':>3} {'chunk':>5} {'reqs':>5} "
        f"{'agg f/s':>9} {'req f/s':>8} {'ttff p50':>9} {'p95':>8} {'GiB':>6} {'step ms':>8} {'dec f/s':>8}"
    )
    print(header)
    for r in all_results:
        step = "-" if "decode_step_ms" not in r else f"{r['decode_step_ms']:.3f}"
        decode = "-" if "decode_frames_per_s" not in r else f"{r['decode_frames_per_s']:.1f}"
        overlap = "on" if r.get("overlap_prefill", True) else "off"
        print(
            f"{r['weight_format']:>6} {r.get('kv_cache_dtype', 'auto'):>4} {r['concurrency']:>5} "
            f"{r['shared_prefix']:>6} {overlap:>3} {r.get('max_prefill_tokens', '-'):>5} "
            f"{r.get('requests', r['concurrency']):>5} "
            f"{r['aggregate_frames_per_s']:>9.1f} {r['per_request_frames_per_s']:>8.1f} "
            f"{r['ttff_p50_ms']:>8.1f}m {r['ttff_p95_ms']:>7.1f}m {r['gpu_memory_gib']:>6.1f} "
            f"{step:>8} {decode:>8}"
        )
    contexts = sorted({r["decode_step_context"] for r in all_results if "decode_step_context" in r})
    if contexts:
        shown = ", ".join(map(str, contexts))
        print(f"step ms: decode step at batch = conc, CUDA-graph replays at {shown} keys (the gate's number)")
        for b in r.get("breakdown", []):
            print(
                f"  breakdown bs={b['batch']}: step {b['step_ms']:.2f} ms ({b['frames_per_s']:.0f} f/s), "
                f"slow {b['slow_ms']:.2f} ms, head+fast {b['head_fast_ms']:.2f} ms, attention/layer "
                f"triton {b['attn_layer_triton_us']:.1f} us, "
                f"sdpa-gather {b['attn_layer_sdpa_gather_us']:.1f} us"
            )
        if "naive_batch1_frames_per_s" in r:
            print(f"naive batch-1 loop: {r['naive_batch1_frames_per_s']:.1f} frames/s")
    for line in ratio_lines(all_results):
        print(line)
    for weight_format in sorted({r["weight_format"] for r in all_results}):
        _, lines = check_targets(select_results(all_results, weight_format), weight_format)
        print("\n".join(lines))


def ratio_lines(all_results: list[dict]) -> list[str]:
    """fp8 / bf16 weights per (concurrency, shared prefix) measured in this run, KV in the model
    dtype (ttff: bf16 / fp8); then fp8 / model-dtype KV cache per weight format."""
    lines = []
    model_kv = [r for r in all_results if r.get("kv_cache_dtype", "auto") == "auto"]
    bf16 = {(r["concurrency"], r["shared_prefix"]): r for r in model_kv if r["weight_format"] == "bf16"}
    for r in model_kv:
        base = bf16.get((r["concurrency"], r["shared_prefix"]))
        if r["weight_format"] != "fp8" or base is None:
            continue
        agg = r["aggregate_frames_per_s"] / base["aggregate_frames_per_s"]
        req = r["per_request_frames_per_s"] / base["per_request_frames_per_s"]
        ttff = base["ttff_p50_ms"] / r["ttff_p50_ms"]
        line = (
            f"fp8/bf16 conc {r['concurrency']} prefix {r['shared_prefix']}: aggregate {agg:.2f}x, "
            f"per-request {req:.2f}x, ttff p50 {ttff:.2f}x faster"
        )
        if "decode_step_ms" in r and "decode_step_ms" in base:
            line += f"; decode step {base['decode_step_ms'] / r['decode_step_ms']:.2f}x"
        for b, bb in zip(r.get("breakdown", []), base.get("breakdown", []), strict=False):
            line += f"; step bs={b['batch']} {bb['step_ms'] / b['step_ms']:.2f}x"
        lines.append(line)
    by_key = {(r["weight_format"], r["concurrency"], r["shared_prefix"]): r for r in model_kv}
    for r in all_results:
        base = by_key.get((r["weight_format"], r["concurrency"], r["shared_prefix"]))
        if r.get("kv_cache_dtype") != "fp8" or base is None:
            continue
        line = (
            f"kv fp8/auto {r['weight_format']} conc {r['concurrency']} prefix {r['shared_prefix']}: "
            f"aggregate {r['aggregate_frames_per_s'] / base['aggregate_frames_per_s']:.3f}x"
        )
        if "decode_step_ms" in r and "decode_step_ms" in base:
            line += f", decode step {base['decode_step_ms'] / r['decode_step_ms']:.3f}x faster"
        lines.append(line)
    return lines
