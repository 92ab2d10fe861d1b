"""The graph-safe decode step (`engine/decode_step.py`) on the CPU.

- torch-ops path, float64: the engine with `decode_step="fast"` (restricted S2 head, compacted
  sampling, 2-token first fast pass, prefill frames too) equals `reference.generate`;
- kernel path (Triton interpreter, float32): the same step with the fused kernels (RMSNorm +
  residual, QK-norm + RoPE + paged KV write, paged attention, sampling, window shift) gives the
  torch path's hidden states and frames, with and without the top-k candidate bound.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402
from model_testing import tiny_s2  # noqa: E402
from prefill_testing import prefill_tokens, prefill_two_prompts  # noqa: E402

from shoal.config import EngineConfig  # noqa: E402
from shoal.engine.batch import DecodeBuffers  # noqa: E402
from shoal.engine.core import EngineCore  # noqa: E402
from shoal.engine.decode_step import DecodeStep  # noqa: E402
from shoal.engine.request import SamplingParams  # noqa: E402
from shoal.models import load_model  # noqa: E402
from shoal.models.prompt import Reference, build_prompt, voice_prefix_length  # noqa: E402
from shoal.models.reference import generate  # noqa: E402
from shoal.models.sampling import logits_to_probs  # noqa: E402
from shoal.tuning import TUNING, Tuning  # noqa: E402


def add(core, model, name, text, params, max_frames, refs=()):
    prompt = build_prompt(model.config, model.tokenizer, text, list(refs))
    request = core.new_request(
        prompt,
        params,
        max_new_frames=max_frames,
        prefix_len=voice_prefix_length(model.config, model.tokenizer, list(refs)),
        request_id=name,
    )
    core.add(request)
    return request, prompt


def test_logits_to_probs_is_graph_safe_and_keeps_rank_zero() -> None:
    """The one sampling-shaping rule (`models.sampling.logits_to_probs`) writes nothing in place
    (a CUDA graph captures it) and keeps rank 0 even at top_p 0 or top_k 1."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g)
    before = logits.clone()
    temperature = torch.tensor([0.7, 1.0, 0.3, 1.2, 0.9])
    top_p = torch.tensor([0.8, 1.0, 0.1, 0.5, 0.0])
    top_k = torch.tensor([30, 1000, 5, 1, 64])
    probs = logits_to_probs(logits, temperature, top_p, top_k)
    assert torch.equal(logits, before)
    assert torch.equal(probs.argmax(dim=-1), logits.argmax(dim=-1))
    assert torch.equal((probs[3:] > 0).sum(dim=-1), torch.tensor([1, 1]))


def test_fast_step_engine_equals_reference(golden_dir) -> None:
    model = tiny_s2(golden_dir, torch.float64)
    config = EngineConfig(
        device="cpu", dtype="float64", num_pages=128, page_size=4, max_prefill_tokens=40, decode_step="fast"
    )
    core = EngineCore(model, config)
    assert core.runner.step is not None and not core.runner.step.use_kernels
    assert (
        core.runner.step.head_weight.shape[0]
        == model.config.semantic_end_id - model.config.semantic_begin_id + 2
    )
    g = torch.Generator().manual_seed(3)
    refs = [Reference("voice", torch.randint(0, 64, (4, 9), generator=g))]
    jobs = []
    for i, text in enumerate(["hello there", "a b c d e", "short", "numbers 1 2 3 4", "ok"]):
        params = SamplingParams(
            temperature=0.5 + 0.1 * i, top_p=0.6 + 0.08 * i, top_k=(3, 30, 100, 1, 64)[i], seed=7 + i
        )
        jobs.append((f"r{i}", text, params, 6 + 5 * i, refs if i % 2 else ()))
    requests, prompts = {}, {}
    pending = list(jobs)
    while pending or core.has_work:
        if pending:  # one arrival per step: batches change composition and stay steady
            name, text, params, frames, voice = pending.pop(0)
            requests[name], prompts[name] = add(core, model, name, text, params, frames, voice)
        core.step()
    for name, _, params, frames, _ in jobs:
        want = generate(
            model,
            prompts[name],
            max_frames=frames,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
        )
        request = requests[name]
        got = request.frames[: request.num_frames].t()
        assert torch.equal(got, want), name


def decoding_core(golden_dir, count: int):
    model = tiny_s2(golden_dir, torch.float32)
    config = EngineConfig(device="cpu", dtype="float32", num_pages=64, page_size=16, decode_step="fast")
    core = EngineCore(model, config)
    requests = []
    for i in range(count):
        params = SamplingParams(temperature=0.6 + 0.1 * i, top_p=0.9, top_k=(5, 40, 2)[i % 3], seed=i)
        requests.append(add(core, model, f"k{i}", "text " * (1 + i), params, 40)[0])
    while not all(r.num_frames >= 3 for r in requests):  # RAS windows hold frames
        core.step()
    return core, requests


@pytest.mark.parametrize(
    "capped,fused_fast,head_kernel",
    [(True, False, False), (False, False, False), (True, True, False), (True, False, True)],
    ids=["capped", "full", "fused-fast", "head-kernel"],
)
@pytest.mark.interpreter
def test_kernel_step_equals_torch_step(
    golden_dir, capped: bool, fused_fast: bool, head_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fused-fast`: the fast transformer through `kernels/fast_attention.py` (one launch per layer);
    `head-kernel`: every output head on `kernels/output_head.py` (batch 1 only by default)."""
    core, requests = decoding_core(golden_dir, 3)
    runner = core.runner
    fast_range = {"two_launch_fast_from": 1, "two_launch_fast_to": 0 if fused_fast else 1 << 30}
    tuning = TUNING.with_fields(**fast_range, head_kernel_max_rows=64 if head_kernel else 0)
    kernel_step = DecodeStep(
        runner.model, runner.kv, runner.max_batch, use_kernels=True, max_top_k=64, tuning=tuning
    )
    assert kernel_step.tuning.fuses_fast_attention(len(requests)) == fused_fast
    torch_step = runner.step
    fields = runner.host.fill(requests)
    n = len(requests)

    def copy() -> DecodeBuffers:
        buffers = DecodeBuffers.allocate(n, runner.max_pages, runner.window_size, runner.num_rows, "cpu")
        for name in fields:
            getattr(buffers, name).copy_(getattr(runner.host.host, name)[:n])
        buffers.frames.fill_(-7)  # poison: every element must be written
        return buffers

    a, b = copy(), copy()
    with torch.no_grad():
        hidden_t, normed_t = torch_step.slow(a)
        hidden_k, normed_k = kernel_step.slow(b)
        torch.testing.assert_close(hidden_k, hidden_t, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(normed_k, normed_t, rtol=1e-5, atol=1e-5)
        a, b = copy(), copy()
        torch_step(a, capped)
        kernel_step(b, capped)
    assert (b.frames >= 0).all()
    assert torch.equal(b.frames, a.frames)
    assert torch.equal(b.window, a.window)
    assert torch.equal(b.tokens, b.frames)


@pytest.mark.interpreter
def test_kernel_step_never_writes_what_its_kernels_read_before_the_pdl_wait(golden_dir) -> None:
    """The PDL contract (docs/engine.md): kernels read the step's metadata, sampling parameters and
    the fast passes' constant buffers before waiting for the kernel in front of them, which is
    sound only while no kernel of the step writes them. A step that wrote one would race on the
    GPU without failing a bit-level test there; here it fails."""
    core, requests = decoding_core(golden_dir, 3)
    runner = core.runner
    step = DecodeStep(runner.model, runner.kv, runner.max_batch, use_kernels=True, max_top_k=64)
    fields = runner.host.fill(requests)
    n = len(requests)
    buffers = DecodeBuffers.allocate(n, runner.max_pages, runner.window_size, runner.num_rows, "cpu")
    for name in fields:
        getattr(buffers, name).copy_(getattr(runner.host.host, name)[:n])
    read_early = ("positions", "slots", "block_tables", "kv_lens", "frame_index", "temperature", "top_p")
    read_early += ("top_k", "seed")
    constants = [step.pass0_positions, step.pass0_slots, step.pass0_lens, step.pass0_starts, step.fast_tables]
    for table in (step.pass_positions, step.pass_slots, step.pass_lens):
        constants.extend(table.values())
    before = [getattr(buffers, name).clone() for name in read_early] + [t.clone() for t in constants]
    with torch.no_grad():
        step(buffers, True)
    after = [getattr(buffers, name) for name in read_early] + constants
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old, new)


@pytest.mark.interpreter
@pytest.mark.parametrize("chunks", [None, 4])
def test_kernel_step_with_wide_rows_equals_torch_step(
    tmp_path, chunks: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny S2 model with 256 codes per codebook: the main row (256 semantic ids + `<|im_end|>`,
    one column past a power of two) and the codebook rows are wider than the 64 candidates the
    capped kernel extracts, so the step reaches the split last column and the radix selection
    that the golden model's 64-column rows skip (they sort the whole tile); with
    `chunks` the step's `sample_chunks` switch spreads each sampled row over that many programs."""
    from shoal.models.writer import tiny_config, write_checkpoint

    config = tiny_config("s2").replace(vocab_size=768, codebook_size=256, semantic_end_id=655)
    write_checkpoint(tmp_path, config, seed=5)
    model = load_model(tmp_path, dtype=torch.float32)
    model.build_rope_tables("cpu")
    core = EngineCore(
        model, EngineConfig(device="cpu", dtype="float32", num_pages=64, page_size=16, decode_step="fast")
    )
    requests = []
    for i in range(3):
        params = SamplingParams(temperature=0.8 + 0.1 * i, top_p=0.95, top_k=(50, 64, 3)[i], seed=7 + i)
        requests.append(add(core, model, f"w{i}", "text " * (2 + i), params, 30)[0])
    while not all(r.num_frames >= 3 for r in requests):
        core.step()
    runner = core.runner
    kernel_step = DecodeStep(runner.model, runner.kv, runner.max_batch, use_kernels=True, max_top_k=64)
    kernel_step.tuning = kernel_step.tuning.with_fields(sample_chunks=chunks)
    assert kernel_step.column_ids.numel() == 257
    fields = runner.host.fill(requests)
    results = []
    for step in (runner.step, kernel_step):
        buffers = DecodeBuffers.allocate(
            len(requests), runner.max_pages, runner.window_size, runner.num_rows, "cpu"
        )
        for name in fields:
            getattr(buffers, name).copy_(getattr(runner.host.host, name)[: len(requests)])
        buffers.frames.fill_(-7)
        with torch.no_grad():
            step(buffers, True)
        results.append(buffers.frames.clone())
    assert (results[1] >= 0).all()
    assert torch.equal(results[1], results[0])


@pytest.mark.interpreter
def test_fused_prefill_equals_model_forward(golden_dir) -> None:
    """Two prompts (one continuing after a cached chunk) through the fused-kernel prefill."""
    from shoal.engine.kv_cache import PagedKV

    model = tiny_s2(golden_dir, torch.float32)
    mc = model.config
    tokens = prefill_tokens(mc)
    outputs = []
    for fused in (False, True):
        # sequence A: 9 tokens in pages [0, 1, 2]; sequence B: 14 tokens in pages [3, 4, 5, 6]
        kv = PagedKV(mc.n_layer, 8, 4, mc.n_local_heads, mc.head_dim, torch.float32, "cpu")
        hidden, normed = prefill_two_prompts(model, kv, tokens, fused)
        outputs.append((hidden, normed, kv.k.clone()))
    torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outputs[1][1], outputs[0][1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outputs[1][2][:, :7], outputs[0][2][:, :7], rtol=1e-5, atol=1e-5)


def test_norm_slice_groups_by_rows() -> None:
    """4 groups per norm program up to 8 rows, 8 from 9 to 16, none (one program per row) above;
    `SHOAL_NORM_SLICE_GROUPS` sets one size for every split norm."""
    tuning = Tuning.from_environment({})
    assert [tuning.norm_slice_groups_for(rows) for rows in (0, 1, 8, 9, 16, 17)] == [0, 4, 4, 8, 8, 0]
    tuning = Tuning.from_environment({"SHOAL_NORM_SLICE_GROUPS": "2"})
    assert [tuning.norm_slice_groups_for(rows) for rows in (1, 16, 17)] == [2, 2, 0]


def test_fused_fast_attention_range_and_refused_overrides() -> None:
    fused = [Tuning().fuses_fast_attention(batch) for batch in (1, 16, 17, 39, 40, 128)]
    assert fused == [True, True, False, False, True, True]
    with pytest.raises(ValueError, match="SHOAL_HEAD_KERNEL_MAX_ROWS"):
        Tuning.from_environment({"SHOAL_HEAD_KERNEL_MAX_ROWS": "sometimes"})
    with pytest.raises(ValueError, match="fp8_prefill"):
        Tuning.from_environment({"SHOAL_FP8_PREFILL": "fast"})
    with pytest.raises(ValueError, match="unknown tuning fields"):
        Tuning().with_fields(no_such_switch=1)


@pytest.mark.interpreter
def test_slow_attention_takes_the_cache_dtypes_tuned_config(
    golden_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 cache's decode attention runs the bf16 table's entry for the batch, never the e4m3
    cache's (whose configs are slower on bf16 keys: a 1.6x slower attention at batch 64)."""
    from shoal.kernels import attention
    from shoal.kernels.attention import decode_config

    core, requests = decoding_core(golden_dir, 3)
    runner = core.runner
    assert not runner.kv.layer(0).fp8
    step = DecodeStep(runner.model, runner.kv, runner.max_batch, use_kernels=True, max_top_k=64)
    fields = runner.host.fill(requests)
    n = len(requests)
    buffers = DecodeBuffers.allocate(n, runner.max_pages, runner.window_size, runner.num_rows, "cpu")
    for name in fields:
        getattr(buffers, name).copy_(getattr(runner.host.host, name)[:n])
    configs = []
    launch = attention.paged_decode_attention

    def recording(*args, config=None, **kwargs):
        configs.append(config)
        return launch(*args, config=config, **kwargs)

    monkeypatch.setattr(attention, "paged_decode_attention", recording)
    with torch.no_grad():
        step.slow(buffers)
    assert configs and all(config == decode_config(n) for config in configs)
    assert decode_config(n) != decode_config(n, kv_fp8=True)
