"""`shoal bench engine`: decode throughput and time to first frame of the batching engine.

Without `--checkpoint` the model is S2-Pro-shaped (the full-size config) with random weights
built directly on the GPU: no file, no tokenizer. Prompts are `--prompt-tokens` long, either
all different or sharing a voice prefix (`--shared-prefix` tokens). Output length is fixed
(`ignore_eos`). Per concurrency it reports aggregate frames/s, per-request decode frames/s,
time to first frame (p50/p95) and peak GPU memory, plus a naive batch-1 loop
(`models.reference.generate`) on the same model for comparison.

`--weight-format bf16 fp8` runs both engines in one call, one after the other on the same random
weights (FP8: quantized at engine start, `quant/engine_fp8.py`), prints fp8/bf16 ratios and checks
the issue's targets (`bench/gate.py: TARGETS`). `--fp8-sweep` times every FP8 projection variant
per S2-Pro GEMM shape and M as CUDA-graph replays and prints `VARIANT_TABLE` entries to paste.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time

import torch

from shoal.config import EngineConfig
from shoal.engine.api import FinishReason
from shoal.engine.engine import EngineCore
from shoal.engine.request import SamplingParams

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


def build_random_s2(device: str, dtype: torch.dtype, seed: int = 0):
    """The full-size S2-Pro module tree with random weights, allocated on `device` directly."""
    from shoal.models.config import parse_config
    from shoal.models.dual_ar import DualARTransformer

    config = parse_config(S2_PRO_CONFIG)
    torch.manual_seed(seed)
    with torch.device(device):
        model = DualARTransformer(config).to(dtype)
        for param in model.parameters():
            if param.dim() >= 2:  # keep activations in a sane range at this width
                torch.nn.init.normal_(param, std=0.02)
        model.build_rope_tables(device)
    return model.eval()


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
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    start = time.perf_counter()
    requests = []
    for i, prompt in enumerate(prompts):
        request = core.new_request(
            prompt, SamplingParams(seed=i), max_new_frames=frames, prefix_len=prefix_len
        )
        request.arrival_perf = time.perf_counter()
        core.add(request)
        requests.append(request)
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    while core.has_work:
        for request in core.step():
            now = time.perf_counter()
            first.setdefault(id(request), now)
            if request.finish_reason is not None:
                done[id(request)] = now
    wall = time.perf_counter() - start
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)
    ttff = sorted(first[id(r)] - r.arrival_perf for r in requests)
    rates = [(frames - 1) / max(done[id(r)] - first[id(r)], 1e-9) for r in requests]
    return {
        "concurrency": len(prompts),
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


def _time_graph(fn, reps: int = 30) -> float:
    """Median ms of `reps` replays of `fn` captured as one CUDA graph (after a warm-up)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.no_grad()
def breakdown(core: EngineCore, batches: list[int], context: int) -> list[dict]:
    """Where a decode step's time goes: the whole step, the slow model alone, one layer's
    attention (Triton paged kernel vs SDPA over a gathered contiguous view), each timed as
    CUDA-graph replays on synthetic rows of `context` keys in distinct pages."""
    runner = core.runner
    pages_per_row = -(-context // runner.page_size)
    results = [
        _breakdown_one(core, batch, context)
        for batch in batches
        if batch <= runner.max_batch and (batch + 1) * pages_per_row <= runner.kv.scratch_page
    ]
    runner.host.invalidate()
    return results


def _breakdown_one(core: EngineCore, batch: int, context: int) -> dict:
    from shoal.kernels.attention import paged_decode_attention

    runner, step = core.runner, core.runner.step
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
    full = _time_graph(lambda: step(view))
    slow = _time_graph(lambda: step.slow(view))
    q = torch.randn(batch, 32, 128, device=runner.device, dtype=runner.dtype)
    k_pages, v_pages = kv.k[0], kv.v[0]
    triton_ms = _time_graph(
        lambda: paged_decode_attention(q, k_pages, v_pages, view.block_tables, view.kv_lens)
    )
    index = view.block_tables[:, :pages_per_row].long()

    def sdpa():
        keys = k_pages[index].flatten(1, 2)[:, :context].transpose(1, 2)
        values = v_pages[index].flatten(1, 2)[:, :context].transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=True)

    sdpa_ms = _time_graph(sdpa)
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
) -> list[dict]:
    """One result dict per concurrency (the performance gate reads `per_request_frames_per_s`)."""
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
        max_seq_len=prompt_tokens + frames + 16,
        memory_fraction=0.6,
        use_cuda_graphs=use_cuda_graphs,
        ignore_eos=True,
        weight_format=weight_format,
    )
    core = EngineCore(model, config)  # weight_format="fp8" quantizes the model in place
    results = []
    for concurrency in concurrencies:
        prompts = make_prompts(model, concurrency, prompt_tokens, shared_prefix, seed=concurrency)
        run_level(core, prompts[:1], 4, shared_prefix)  # warm the prefill path
        result = run_level(core, prompts, frames, shared_prefix)
        result["shared_prefix"] = shared_prefix
        result["weight_format"] = weight_format
        result["prompt_tokens"] = prompt_tokens
        results.append(result)
    if breakdown_batches and core.runner.step is not None and torch.cuda.is_available():
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
    from shoal.quant.engine_fp8 import VARIANTS, Fp8Projections, m_bucket, prepare_model

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
                timings[variant] = 1000 * _time_graph(call)
            best = min(timings, key=timings.get)
            rows.append({"shape": name, "n": w.n, "k": w.k, "m": m, "us": timings, "best": best})
    return rows


def print_sweep(rows: list[dict]) -> None:
    from shoal.quant.engine_fp8 import VARIANTS, m_bucket

    print(f"{'shape':>12} {'m':>5} " + " ".join(f"{v:>12}" for v in VARIANTS) + "  best")
    for r in rows:
        cells = " ".join(f"{r['us'][v]:>12.1f}" for v in VARIANTS)
        print(f"{r['shape']:>12} {r['m']:>5} {cells}  {r['best']}")
    print("VARIANT_TABLE entries (shoal/quant/engine_fp8.py):")
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
        "--weight-format",
        nargs="+",
        choices=("bf16", "fp8"),
        default=["bf16"],
        help="one or more, run one after the other (`bf16 fp8`: ratios side by side)",
    )
    parser.add_argument(
        "--fp8-sweep",
        type=int,
        nargs="*",
        default=None,
        metavar="M",
        help="first time every FP8 projection variant at these M (default 1 2 4 8 16 32 64 128 300 2048)",
    )


def run(args: argparse.Namespace) -> int:
    sweep = None
    if args.fp8_sweep is not None:
        sweep = fp8_sweep(args.fp8_sweep or [1, 2, 4, 8, 16, 32, 64, 128, 300, 2048], args.device)
        free_gpu()
        print_sweep(sweep)
    all_results = []
    for weight_format in args.weight_format:
        for shared in args.shared_prefix:
            all_results += run_engine_bench(
                args.checkpoint,
                args.concurrency,
                frames=args.frames,
                prompt_tokens=args.prompt_tokens,
                shared_prefix=shared,
                device=args.device,
                dtype=args.dtype,
                use_cuda_graphs=not args.no_graphs,
                naive=not args.no_naive and shared == args.shared_prefix[0],
                breakdown_batches=args.breakdown if shared == args.shared_prefix[0] else None,
                weight_format=weight_format,
            )
            free_gpu()
    print_results(all_results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"results": all_results, "fp8_sweep": sweep}, f, indent=2)
    return 0


def print_results(all_results: list[dict]) -> None:
    from shoal.bench.gate import check_targets, select_results

    header = (
        f"{'format':>6} {'conc':>5} {'prefix':>6} {'agg f/s':>9} {'req f/s':>8} "
        f"{'ttff p50':>9} {'p95':>8} {'GiB':>6}"
    )
    print(header)
    for r in all_results:
        print(
            f"{r['weight_format']:>6} {r['concurrency']:>5} {r['shared_prefix']:>6} "
            f"{r['aggregate_frames_per_s']:>9.1f} {r['per_request_frames_per_s']:>8.1f} "
            f"{r['ttff_p50_ms']:>8.1f}m {r['ttff_p95_ms']:>7.1f}m {r['gpu_memory_gib']:>6.1f}"
        )
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
    """fp8 / bf16 per (concurrency, shared prefix) measured in this run (ttff: bf16 / fp8)."""
    bf16 = {(r["concurrency"], r["shared_prefix"]): r for r in all_results if r["weight_format"] == "bf16"}
    lines = []
    for r in all_results:
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
        for b, bb in zip(r.get("breakdown", []), base.get("breakdown", []), strict=False):
            line += f"; step bs={b['batch']} {bb['step_ms'] / b['step_ms']:.2f}x"
        lines.append(line)
    return lines
