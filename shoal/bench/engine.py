"""`shoal bench engine`: decode throughput and time to first frame of the batching engine.

Without `--checkpoint` the model is S2-Pro-shaped with random weights built on the GPU (no file,
no tokenizer). Prompts are `--prompt-tokens` long, all different or sharing a voice prefix
(`--shared-prefix`); output length is fixed (`ignore_eos`). Per concurrency it reports aggregate
and per-request frames/s, time to first frame (p50/p95) and peak GPU memory, plus a naive batch-1
loop (`models.reference.generate`). Whole-request numbers carry prefill, scheduling and host
jitter, so each row also carries the decode step alone at batch = concurrency, timed as CUDA-graph
replays on synthetic rows of `--step-context` keys: the number the performance gate compares.
`--json FILE` writes the rows, the sweep and the run's environment for `shoal gate performance
--results FILE`. `--weight-format bf16 fp8` runs both engines one after the other and prints
their ratios and the targets (`bench/targets.py`). `--fp8-sweep` times every FP8 projection
variant per S2-Pro GEMM shape and M; `--write-table` merges the fastest into
`kernels/tuned/fp8_variants.json`.
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
import subprocess
import sys
import time
from pathlib import Path

import torch

from shoal.bench.random_checkpoint import S2_PRO_CONFIG
from shoal.bench.targets import check_targets, select_results
from shoal.bench.timing import time_graph_ms
from shoal.config import KV_CACHE_DTYPES, EngineConfig
from shoal.engine.api import FinishReason
from shoal.engine.engine import EngineCore
from shoal.engine.request import SamplingParams
from shoal.tuning import environment as environment_setting


def build_random_s2(device: str, dtype: torch.dtype, seed: int = 0, slow_layers: int | None = None):
    """The full-size S2-Pro module tree with random weights, allocated on `device` directly;
    `slow_layers`: that many slow transformer layers instead of 36 (S2-Pro's shapes, less time)."""
    from shoal.models.config import parse_config
    from shoal.models.dual_ar import DualARTransformer

    fields = copy.deepcopy(S2_PRO_CONFIG)  # the official config.json
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
        "concurrency": concurrency, "requests": len(prompts), "frames": frames,
        "aggregate_frames_per_s": len(prompts) * frames / wall,
        "per_request_frames_per_s": statistics.mean(rates), "ttff_p50_ms": 1000 * statistics.median(ttff),
        "ttff_p95_ms": 1000 * ttff[min(len(ttff) - 1, int(0.95 * len(ttff)))],
        "gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
        "wall_s": wall,
    }  # fmt: skip


def naive_batch1(model, prompt: torch.Tensor, frames: int) -> dict:
    """The oracle generation loop (eager, batch 1) on the same model: the baseline to beat.
    (It may stop early at a sampled `<|im_end|>`; the rate counts the frames it made.)"""
    from shoal.models.reference import generate

    generate(model, prompt, max_frames=4, temperature=0.8, top_p=0.8)  # warm up
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    start = time.perf_counter()
    out = generate(model, prompt, max_frames=frames, temperature=0.8, top_p=0.8)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
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


def run_engine_bench(
    checkpoint: str | None = None, concurrencies: list[int] | None = None, *, frames: int = 128,
    prompt_tokens: int = 300, shared_prefix: int = 0, device: str = "cuda", dtype: str = "bfloat16",
    use_cuda_graphs: bool = True, naive: bool = False, breakdown_batches: list[int] | None = None,
    weight_format: str = "bf16", step_timing: bool = True, step_context: int | None = None,
    ttff_samples: int = 7, max_seq_len: int | None = None, prefill_graphs: bool = True,
    prefill_graph_segments: int = EngineConfig.prefill_graph_segments,
    prefill_graph_buckets: tuple[int, ...] | None = None, kv_cache_dtype: str = "auto", closed_loop: int = 0,
    overlap_prefill: bool = True, max_prefill_tokens: tuple[int, ...] = (),
) -> list[dict]:  # fmt: skip
    """One result dict per concurrency. `closed_loop`: that many requests per level with up to
    `concurrency` running at once (`run_closed_loop`); `max_prefill_tokens`: each concurrency once
    per prefill budget, side by side on one engine (empty: the config's default). With
    `step_timing` (on a GPU) each row also carries the decode step at batch = concurrency as
    CUDA-graph replays at `step_context` keys (default `prompt_tokens + frames // 2`):
    `decode_step_ms`, `decode_step_context` and `decode_frames_per_s` = 1000 / step ms, what the
    performance gate compares. At concurrency 1 the first-frame time is the median over the
    level's request and `ttff_samples` more (p95 column: the worst). `max_seq_len` (default: what
    the requests need) sizes the block tables, hence the decode attention's split count:
    `shoal serve` uses the model's (32,768 for S2-Pro)."""
    concurrencies = concurrencies or [1, 4, 16, 64]
    torch_dtype = getattr(torch, dtype)
    if checkpoint:
        from shoal.models import load_model

        model = load_model(checkpoint, device=device, dtype=torch_dtype)
    else:
        model = build_random_s2(device, torch_dtype)
    config = EngineConfig(
        device=device, dtype=dtype, max_running_requests=max(concurrencies),
        max_seq_len=max_seq_len or max(prompt_tokens + frames, step_context or 0) + 16, memory_fraction=0.6,
        use_cuda_graphs=use_cuda_graphs, ignore_eos=True, weight_format=weight_format,
        prefill_graphs=None if prefill_graphs else False, prefill_graph_segments=prefill_graph_segments,
        kv_cache_dtype=kv_cache_dtype, overlap_prefill=overlap_prefill,
        **({"prefill_graph_buckets": tuple(prefill_graph_buckets)} if prefill_graph_buckets else {}),
    )  # fmt: skip
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
        result.update(
            shared_prefix=shared_prefix, weight_format=weight_format, kv_cache_dtype=kv_cache_dtype,
            prompt_tokens=prompt_tokens, max_seq_len=config.max_seq_len,
            prefill_graphs=core.runner.prefill_graphs is not None,
            prefill_graph_segments=prefill_graph_segments,
            prefill_graph_buckets=list(config.prefill_graph_buckets), overlap_prefill=overlap_prefill,
            closed_loop=closed_loop, max_prefill_tokens=budget,
        )  # fmt: skip
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
    model), as CUDA-graph replays on reserved buffers: what the variant table is chosen from."""
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
    from shoal.engine.fp8_weights import VARIANTS

    print(f"{'shape':>12} {'m':>5} " + " ".join(f"{v:>12}" for v in VARIANTS) + "  best")
    for r in rows:
        cells = " ".join(f"{r['us'][v]:>12.1f}" for v in VARIANTS)
        print(f"{r['shape']:>12} {r['m']:>5} {cells}  {r['best']}")


def sweep_winners(rows: list[dict]) -> dict[tuple[int, int, int], str]:
    """{(N, K, M bucket): fastest variant} of `fp8_sweep` rows: the variant table's entries."""
    from shoal.engine.fp8_weights import m_bucket

    return {(r["n"], r["k"], m_bucket(r["m"])): r["best"] for r in rows}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    # fmt: off
    add("--checkpoint", default=None, help="default: random S2-Pro-shaped weights")
    add("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    add("--frames", type=int, default=128, help="frames per request (fixed)")
    add("--prompt-tokens", type=int, default=300)
    add("--shared-prefix", type=int, nargs="+", default=[0, 200], help="voice prefix tokens")
    add("--device", default="cuda")
    add("--dtype", default="bfloat16")
    add("--no-graphs", action="store_true")
    add("--no-naive", action="store_true", help="skip the naive batch-1 loop")
    add("--json", default=None, help="also write the results here")
    add("--breakdown", type=int, nargs="*", default=[1, 64], help="batches timed part by part (graphs)")
    add("--step-context", type=int, default=None,
        help="keys per row of the timed decode step (default prompt + frames/2)")
    add("--max-seq-len", type=int, default=None,
        help="block-table width (default prompt + frames + 16; shoal serve: the model's)")
    add("--prefill-graphs", choices=("off", "on"), default="on", help="prefill chunks as CUDA graphs")
    add("--prefill-graph-segments", type=int, default=EngineConfig.prefill_graph_segments,
        help="chunks packed into one prefill replay")
    add("--prefill-graph-buckets", type=int, nargs="+", default=None, metavar="TOKENS",
        help="token buckets of the prefill graphs")
    add("--closed-loop", type=int, default=0, metavar="REQUESTS",
        help="per level, this many requests with up to `concurrency` running (one new one per step)")
    add("--overlap-prefill", nargs="+", choices=("on", "off"), default=["on"],
        help="prefill graphs beside the decode on a stream of their own; `on off`: side by side")
    add("--max-prefill-tokens", type=_positive_int, nargs="+", default=None, metavar="TOKENS",
        help="the step's prefill budget, one or more (`8192 2048`: side by side on one engine)")
    add("--weight-format", nargs="+", choices=("bf16", "fp8"), default=["bf16"], help="one or more")
    add("--kv-cache-dtype", nargs="+", choices=KV_CACHE_DTYPES, default=["auto"], help="one or more")
    add("--fp8-sweep", type=int, nargs="*", default=None, metavar="M",
        help="first time every FP8 projection variant at these M (default 1 2 4 8 16 32 64 128 300 2048)")
    add("--write-table", action="store_true", help="--fp8-sweep: merge the winners into the variant table")
    # fmt: on


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
        if args.write_table:
            from shoal.engine.fp8_weights import write_variant_table

            print(f"wrote {write_variant_table(sweep_winners(sweep))}")
    all_results = []
    first_level = (args.shared_prefix[0], args.kv_cache_dtype[0])  # the naive loop runs once
    for weight_format, kv_cache_dtype, shared, overlap in itertools.product(
        args.weight_format, args.kv_cache_dtype, args.shared_prefix, args.overlap_prefill
    ):
        all_results += run_engine_bench(
            args.checkpoint, args.concurrency, frames=args.frames, prompt_tokens=args.prompt_tokens,
            shared_prefix=shared, device=args.device, dtype=args.dtype, use_cuda_graphs=not args.no_graphs,
            naive=not args.no_naive and (shared, kv_cache_dtype) == first_level,
            breakdown_batches=args.breakdown if shared == args.shared_prefix[0] else None,
            weight_format=weight_format, step_context=args.step_context, max_seq_len=args.max_seq_len,
            prefill_graphs=args.prefill_graphs == "on", prefill_graph_segments=args.prefill_graph_segments,
            prefill_graph_buckets=args.prefill_graph_buckets, kv_cache_dtype=kv_cache_dtype,
            closed_loop=args.closed_loop, overlap_prefill=overlap == "on",
            max_prefill_tokens=tuple(args.max_prefill_tokens or ()),
        )  # fmt: skip
        free_gpu()
    print_results(all_results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            document = {"results": all_results, "fp8_sweep": sweep, "environment": environment()}
            json.dump(document, f, indent=2)
    return 0


def environment(argv: list[str] | None = None) -> dict:
    """What a measurement ran on, stored beside its numbers (`--json`, the gate's baseline): step
    times only compare on the same GPU and software. `commit` comes from the COMMIT environment
    setting (GPU machines get a copy without `.git`: set it there), else from git."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": environment_setting("COMMIT") or _git_head(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "triton": triton_version,
        "command": _command_line(sys.argv if argv is None else argv),
    }  # fmt: skip


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
    """The checked-out commit; None without a checkout or a git binary."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).resolve().parents[2],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


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
