"""One request's prefill chunk on static buffers (`engine/prefill_batch.py`; replayed as
`graphs.PrefillGraphs` on a GPU), run eagerly on the CPU with the kernel step (Triton interpreter):

- a chunk padded to its bucket gives the hidden states and KV cache of the exact-length fused
  prefill (bit for bit when it fills its bucket; else up to the GEMMs' summation order over more
  rows): a fresh prompt in scattered pages, a chunk continuing after a cached one, a chunk exactly
  a bucket long, a single token; padding writes only the scratch page, and a later shorter chunk
  reads nothing an earlier one left in the buffers;
- bad chunks are refused, and only single chunks that fit take the static path;
- the engine with it gives the same frames as without it (chunked prompts, several requests).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402
from model_testing import tiny_s2  # noqa: E402
from test_engine_batching import TEXTS, Collector, submit  # noqa: E402

from shoal.config import EngineConfig  # noqa: E402
from shoal.engine.api import Priority  # noqa: E402
from shoal.engine.core import EngineCore  # noqa: E402
from shoal.engine.decode_step import DecodeStep  # noqa: E402
from shoal.engine.kv_cache import PagedKV  # noqa: E402
from shoal.engine.prefill_batch import PrefillBatch  # noqa: E402
from shoal.engine.request import SamplingParams  # noqa: E402

BUCKETS = (4, 8, 16)
NUM_PAGES, PAGE = 12, 4


@pytest.fixture(scope="module")
def model(golden_dir):
    return tiny_s2(golden_dir, torch.float32)


def kernel_step(model) -> DecodeStep:
    mc = model.config
    kv = PagedKV(mc.n_layer, NUM_PAGES, PAGE, mc.n_local_heads, mc.head_dim, torch.float32, "cpu")
    kv.force_kernel_prefill = True
    kv.k.normal_(generator=torch.Generator().manual_seed(1))  # stale keys must not leak in
    kv.v.normal_(generator=torch.Generator().manual_seed(2))
    return DecodeStep(model, kv, 4, use_kernels=True)


def random_columns(model, count: int, seed: int) -> torch.Tensor:
    """[count, N+1] prompt columns: text tokens and, in every third row, a semantic token."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    columns = torch.zeros(count, c.num_codebooks + 1, dtype=torch.long)
    columns[:, 0] = torch.randint(0, 300, (count,), generator=g)
    semantic = len(columns[::3])
    columns[::3, 0] = c.semantic_begin_id + torch.randint(0, c.codebook_size, (semantic,), generator=g)
    columns[::3, 1:] = torch.randint(0, c.codebook_size, (semantic, c.num_codebooks), generator=g)
    return columns


def exact_prefill(step: DecodeStep, columns: torch.Tensor, start: int, pages: list[int]):
    """The engine's eager fused prefill of one chunk (`ModelRunner.prefill` without the batch)."""
    count = columns.shape[0]
    step.kv.set_varlen([(0, count, start + count, pages)])
    positions = torch.arange(start, start + count)
    return step.prefill(columns, positions, step.kv._slots, step.kv._prefill_meta)


@torch.no_grad()
@pytest.mark.interpreter
def test_padded_chunks_equal_exact_prefill(model) -> None:
    exact, static = kernel_step(model), kernel_step(model)
    batch = PrefillBatch(static, BUCKETS, model.config.num_codebooks + 1, max_pages=8)
    pages = [7, 2, 9, 0, 4]  # scattered, 20 keys
    chunks = [(9, 0), (5, 9), (4, 14), (1, 18)]  # fresh, continuing, a whole bucket, one token
    for i, (count, start) in enumerate(chunks):
        columns = random_columns(model, count, seed=10 + i)
        hidden, normed = exact_prefill(exact, columns, start, pages)
        bucket = batch.fill(columns, start, pages)
        assert bucket == batch.bucket_for(count) and bucket >= count
        batch.compute(bucket)
        # Every page but the scratch page: the same keys and values (padding wrote nowhere else).
        live = slice(0, NUM_PAGES)
        got = (batch.hidden[:count], batch.normed[:count], static.kv.k[:, live], static.kv.v[:, live])
        want = (hidden, normed, exact.kv.k[:, live], exact.kv.v[:, live])
        for g, w in zip(got, want, strict=True):
            # Padded, the GEMMs run over more rows (M = 1: a GEMV) and the BLAS may sum in
            # another order; unpadded too on some CPUs, whose BLAS picks kernels by alignment.
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert torch.equal(batch.tokens[1:4], torch.zeros_like(batch.tokens[1:4]))  # the last fill's padding
    scratch = static.kv.scratch_page
    assert (batch.slots[1:4] // PAGE == scratch).all()


@torch.no_grad()
def test_fill_refuses_bad_chunks(model) -> None:
    batch = PrefillBatch(kernel_step(model), BUCKETS, model.config.num_codebooks + 1, max_pages=8)
    columns = random_columns(model, 17, seed=3)
    with pytest.raises(ValueError, match="do not fit"):
        batch.fill(columns, 0, list(range(8)))
    with pytest.raises(ValueError, match="do not fit"):  # one segment: one chunk
        batch.fill_chunks([(columns[:2], 0, [0]), (columns[:2], 0, [1])])
    with pytest.raises(ValueError, match="do not fit"):
        batch.fill(columns[:0], 0, [0])
    with pytest.raises(ValueError, match="columns"):
        batch.fill(columns[:4, :3], 0, [0])
    with pytest.raises(ValueError, match="pages cannot hold"):
        batch.fill(columns[:9], 0, [0, 1])  # 9 keys need 3 pages of 4
    with pytest.raises(ValueError, match="pages cannot hold"):
        batch.fill(columns[:4], 0, list(range(9)))  # wider than the static block table
    with pytest.raises(ValueError, match="positive"):
        PrefillBatch(kernel_step(model), (0, 8), model.config.num_codebooks + 1, max_pages=8)
    with pytest.raises(ValueError, match="prefill_graph_buckets"):
        EngineConfig(prefill_graph_buckets=())
    with pytest.raises(ValueError, match="segments"):
        PrefillBatch(kernel_step(model), BUCKETS, model.config.num_codebooks + 1, max_pages=8, segments=0)
    with pytest.raises(ValueError, match="prefill_graph_segments"):
        EngineConfig(prefill_graph_segments=0)


@torch.no_grad()
@pytest.mark.interpreter
def test_packed_chunks_equal_the_eager_varlen_prefill(model) -> None:
    """Several requests' chunks in one static prefill (`segments` 4): a fresh prompt, a chunk
    continuing after cached keys and a single token, packed and padded, against the eager varlen
    prefill of the same three segments; then four chunks that fill their bucket exactly."""
    exact, static = kernel_step(model), kernel_step(model)
    batch = PrefillBatch(static, BUCKETS, model.config.num_codebooks + 1, max_pages=8, segments=4)
    tables = ([7, 2, 9], [0, 4, 11, 8], [5, 6], [1, 3])  # scattered pages, disjoint per request
    cases = (
        [(5, 0, 0), (4, 9, 1), (1, 6, 2)],  # (count, start, table): 10 tokens -> bucket 16
        [(6, 0, 0), (4, 2, 1), (3, 0, 2), (3, 4, 3)],  # 16 tokens: the bucket exactly
    )
    for case, chunks in enumerate(cases):
        packed, segments, offset = [], [], 0
        for i, (count, start, table) in enumerate(chunks):
            columns = random_columns(model, count, seed=40 + 10 * case + i)
            packed.append((columns, start, tables[table]))
            segments.append((offset, count, start + count, tables[table]))
            offset += count
        exact.kv.set_varlen(segments)
        positions = torch.cat([torch.arange(start, start + count) for count, start, _ in chunks])
        columns = torch.cat([c for c, _, _ in packed])
        hidden, normed = exact.prefill(columns, positions, exact.kv._slots, exact.kv._prefill_meta)
        bucket = batch.fill_chunks(packed)
        assert bucket == batch.bucket_for(offset)
        batch.compute(bucket)
        live = slice(0, NUM_PAGES)
        got = (batch.hidden[:offset], batch.normed[:offset], static.kv.k[:, live], static.kv.v[:, live])
        want = (hidden, normed, exact.kv.k[:, live], exact.kv.v[:, live])
        assert all(torch.isfinite(t).all() for t in got[:2]), "the live rows stay finite"
        for g, w in zip(got, want, strict=True):
            if offset == bucket:  # no padding rows: the very same computation
                assert torch.equal(g, w), case
            else:
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert batch.takes([4, 4, 4, 4]) and not batch.takes([4, 4, 4, 4, 0]) and not batch.takes([9, 8])


def engine(model, with_batch: bool, segments: int = 1) -> EngineCore:
    """A CPU engine whose step is the kernel step (as on CUDA); `with_batch`: the static prefill
    with this many segments."""
    config = EngineConfig(
        device="cpu", dtype="float32", num_pages=64, page_size=PAGE, max_prefill_tokens=24,
        max_running_requests=3, graph_buckets=(1, 2, 4), decode_step="fast", first_frame_graphs=True,
        ignore_eos=True, prefill_graph_buckets=(8, 16, 32),
    )  # fmt: skip
    core = EngineCore(model, config)
    runner = core.runner
    runner.step = DecodeStep(model, runner.kv, runner.max_batch, use_kernels=True, max_top_k=64)
    runner.kv.force_kernel_prefill = True
    assert runner.prefill_batch is None  # default None: only where decode graphs are captured
    if with_batch:
        runner.prefill_batch = PrefillBatch(
            runner.step, config.prefill_graph_buckets, runner.num_rows, runner.max_pages, segments
        )
    return core


# Per request: the first frame (from the prefill's last row) and two decode steps reading the
# prefilled keys; each kernel step costs seconds in the Triton interpreter.
TRAFFIC_FRAMES = 3


def run_traffic(core: EngineCore) -> dict[str, torch.Tensor]:
    """Three requests admitted in one step, prompts longer than one prefill step (chunks continue
    after cached ones), and one alone later: each request's frames."""
    sink = Collector()
    requests = []
    for i in range(3):
        params = SamplingParams(seed=7 + i, temperature=0.8, top_k=20, top_p=0.9)
        requests.append(
            submit(core, core.model, sink, f"r{i}", TEXTS[i], [], params, TRAFFIC_FRAMES, Priority.STANDARD)
        )
    for _ in range(3):
        core.step()
    params = SamplingParams(seed=30, top_k=10)
    late = submit(core, core.model, sink, "late", TEXTS[3], [], params, TRAFFIC_FRAMES, Priority.STANDARD)
    requests.append(late)
    core.run_until_idle()
    return {r.request_id: sink.output(r.request_id) for r, _ in requests}


@pytest.fixture(scope="module")
def frames_without_static_prefill(model) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return run_traffic(engine(model, False))


@torch.no_grad()
@pytest.mark.interpreter
@pytest.mark.parametrize("segments", [1, 3])
def test_engine_with_static_prefill_equals_without(
    model, frames_without_static_prefill: dict[str, torch.Tensor], segments: int
) -> None:
    """The traffic of `run_traffic`: with one segment the three admitted prompts' chunks run
    eagerly together, with three they are packed into the static prefill; the late one alone
    takes the static path either way. The same frames as without the static prefill."""
    core = engine(model, True, segments)
    runner = core.runner
    calls = []
    original = runner._prefill_static

    def counting(packed):
        calls.append([columns.shape[0] for columns, _, _ in packed])
        return original(packed)

    runner._prefill_static = counting
    outputs = run_traffic(core)
    assert calls, "no chunk took the static path"
    assert any(sum(counts) > 16 for counts in calls)  # bucket 32: padded
    assert any(len(counts) > 1 for counts in calls) == (segments > 1)
    assert outputs.keys() == frames_without_static_prefill.keys()
    for name, frames in frames_without_static_prefill.items():
        assert frames.shape[1] == TRAFFIC_FRAMES
        assert torch.equal(outputs[name], frames), name


def test_which_chunks_take_the_static_path(model) -> None:
    core = engine(model, True)
    runner = core.runner
    prompt = torch.zeros(runner.num_rows, 40, dtype=torch.long)
    request = core.new_request(prompt, SamplingParams(), max_new_frames=4)
    assert runner.uses_prefill_batch([(request, 32)])
    assert runner.uses_prefill_batch([(request, 1)])
    assert not runner.uses_prefill_batch([(request, 33)])  # past the largest bucket
    assert not runner.uses_prefill_batch([(request, 8), (request, 8)])  # several chunks: eager
    runner.prefill_batch = PrefillBatch(runner.step, (8, 16, 32), runner.num_rows, runner.max_pages, 2)
    assert runner.uses_prefill_batch([(request, 8), (request, 8)])  # two segments: packed
    assert not runner.uses_prefill_batch([(request, 8), (request, 8), (request, 8)])
    assert not runner.uses_prefill_batch([(request, 20), (request, 13)])  # 33 tokens in all
    runner.prefill_batch = None
    assert not runner.uses_prefill_batch([(request, 8)])
