"""`kernels/step_inputs.py`: the slow pass's embedding against `DualARTransformer.embed`, fast pass
0's input against the torch lines of `DecodeStep.frames_from_hidden`."""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch import Tensor  # noqa: E402

from shoal.bench.timing import capture_graph  # noqa: E402
from shoal.kernels import step_inputs  # noqa: E402
from shoal.kernels.step_inputs import BLOCK_D, embed_tokens, fast_pass0_input  # noqa: E402
from shoal.models.dual_ar import DualARTransformer  # noqa: E402
from shoal.models.writer import tiny_config  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_model(dtype: torch.dtype, scale: bool = True, **changes) -> DualARTransformer:
    """A tiny S2 model (4 codebooks of 64 codes, semantic ids 400..463) with random tables."""
    model = DualARTransformer(tiny_config("s2").replace(scale_codebook_embeddings=scale, **changes))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for table in (model.embeddings.weight, model.codebook_embeddings.weight):
            table.copy_(torch.randn(table.shape, generator=gen))
        model.embeddings.weight[1] = -0.0  # + the zero codebook sum of a non-semantic id: +0.0
    return model.to(dtype)


def random_tokens(model: DualARTransformer, rows: int, seed: int) -> Tensor:
    """int32 [rows, N+1] with strided rows: semantic ids (both ends included) and others
    (just outside the semantic range too), valid codes."""
    c, gen = model.config, torch.Generator().manual_seed(seed)
    buffer = torch.randint(0, c.codebook_size, (rows, c.num_codebooks + 3), generator=gen, dtype=torch.int32)
    tokens = buffer[:, 1 : c.num_codebooks + 2]
    tokens[:, 0] = torch.randint(c.semantic_begin_id, c.semantic_end_id + 1, (rows,), generator=gen)
    tokens[1::3, 0] = torch.randint(0, c.vocab_size, (len(range(1, rows, 3)),), generator=gen)
    edges = [c.semantic_begin_id - 1, c.semantic_begin_id, c.semantic_end_id, c.semantic_end_id + 1]
    tokens[:5, 0] = torch.tensor([*edges, 1], dtype=torch.int32)
    return tokens


def run_embed(model: DualARTransformer, tokens: Tensor, out: Tensor | None = None) -> Tensor:
    c = model.config
    return embed_tokens(
        tokens, model.embeddings.weight, model.codebook_embeddings.weight, c.codebook_size,
        c.semantic_begin_id, c.semantic_end_id, c.scale_codebook_embeddings, out=out,
    )  # fmt: skip


def sequential_embed(model: DualARTransformer, tokens: Tensor, divide: bool = True) -> Tensor:
    """`model.embed` with the codebook rows summed one after the other in fp32 from +0.0, then
    rounded once; `divide=False` scales by the fp32 reciprocal as torch does on CUDA."""
    c, tokens = model.config, tokens.long()
    emb, cb = model.embeddings.weight.detach(), model.codebook_embeddings.weight.detach()
    semantic = ((tokens[:, 0] >= c.semantic_begin_id) & (tokens[:, 0] <= c.semantic_end_id))[:, None]
    total = torch.zeros(tokens.shape[0], emb.shape[1])
    for i in range(c.num_codebooks):
        total = total + cb[tokens[:, i + 1] + i * c.codebook_size].float()
    total = torch.where(semantic, total.to(emb.dtype).float(), 0.0)
    x = (emb[tokens[:, 0]].float() + total).to(emb.dtype)
    if c.scale_codebook_embeddings:
        divisor = torch.tensor(math.sqrt(c.num_codebooks + 1), dtype=torch.float32)
        scaled = x.float() / divisor if divide else x.float() * (1 / divisor)
        x = torch.where(semantic, scaled.to(emb.dtype), x)
    return x


def bits(x: Tensor) -> Tensor:
    """The raw bits, so that -0.0 and +0.0 differ."""
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("dim", [64, BLOCK_D + 96])
def test_embed_equals_model_embed(dtype: torch.dtype, scale: bool, dim: int) -> None:
    """The bits of `model.embed`, int32 strided tokens and int64 ones, into a poisoned `out`."""
    model = tiny_model(dtype, scale, dim=dim)
    tokens = random_tokens(model, 37, seed=dim)
    with torch.no_grad():
        want = model.embed(tokens.long())
        assert torch.equal(bits(want), bits(sequential_embed(model, tokens)))
    got = run_embed(model, tokens)
    assert torch.equal(bits(got), bits(want))
    out = torch.full((37, dim), float("nan"), dtype=dtype)
    assert run_embed(model, tokens.long(), out=out) is out and torch.equal(bits(out), bits(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_on_cuda_multiplies_by_the_reciprocal(dtype: torch.dtype, monkeypatch) -> None:
    """Torch on CUDA scales by 1/sqrt(N+1) in fp32 instead of dividing: the kernel's CUDA path,
    forced here on the CPU."""
    monkeypatch.setattr(step_inputs, "_torch_divides", lambda device: False)
    model = tiny_model(dtype)
    tokens = random_tokens(model, 200, seed=3)
    want = sequential_embed(model, tokens, divide=False)
    assert torch.equal(bits(run_embed(model, tokens)), bits(want))
    if dtype == torch.float32:  # the two scalings differ in the last bit for many values
        assert not torch.equal(want, sequential_embed(model, tokens))


def codebook_sum_model(dtype: torch.dtype, num_codebooks: int, dim: int) -> DualARTransformer:
    """Zero token rows and no scaling: the output of a semantic id is the rounded codebook sum."""
    model = tiny_model(dtype, scale=False, dim=dim, num_codebooks=num_codebooks)
    with torch.no_grad():
        model.embeddings.weight.zero_()
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_order_is_sequential_and_torch_within_one_ulp(dtype: torch.dtype) -> None:
    """10 codebooks of positive values spanning 2^-24..2^0, so fp32 partial sums round and the
    order shows; dim 40 is not a whole block of torch's vector sum, whose last columns use its
    interleaved `row_sum` order (module docstring). The kernel equals the sequential reference;
    torch is within one bf16 ulp (bf16 tables) or a few fp32 ulps (fp32 tables)."""
    model = codebook_sum_model(dtype, num_codebooks=10, dim=40)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        cb = model.codebook_embeddings.weight
        exponents = torch.randint(-24, 1, cb.shape, generator=gen).float()
        cb.copy_(torch.rand(cb.shape, generator=gen) * torch.exp2(exponents))
    tokens = random_tokens(model, 400, seed=1)
    tokens[:, 0] = model.config.semantic_begin_id
    got = run_embed(model, tokens)
    assert torch.equal(bits(got), bits(sequential_embed(model, tokens)))
    with torch.no_grad():
        want = model.embed(tokens.long())
    if dtype == torch.bfloat16:
        assert (bits(got).int() - bits(want).int()).abs().max() <= 1
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=0)


@pytest.mark.parametrize(
    "rows,total", [([2**-24, 1.0, 2**-8, 0.0, 2**-24, 0.0], 1.0), ([1.0, 2**-24, 2**-24, 0.0, -1.0], 0.0)]
)
def test_sum_order_edge_cases(rows: list[float], total: float) -> None:
    """Codebook rows (bf16, one per codebook) whose sum depends on the order. In order, the first
    is 1 + 2^-8 in fp32 (the 2^-24s vanish into 1 as ties to even), a bf16 tie rounded to 1.0;
    torch's `row_sum` order sums the 2^-24s first, 1 + 2^-8 + 2^-23 rounds up to 1 + 2^-7: one
    ulp. The second cancels: 0 in order, 2^-23 in `row_sum`'s order (both seen on column 32 of
    dim 33, a tail column of torch's x86 sum)."""
    model = codebook_sum_model(torch.bfloat16, num_codebooks=len(rows), dim=33)
    size = model.config.codebook_size
    with torch.no_grad():
        for i, value in enumerate(rows):
            model.codebook_embeddings.weight[i * size] = value
        tokens = torch.zeros(1, len(rows) + 1, dtype=torch.int32)
        tokens[0, 0] = model.config.semantic_begin_id
        want = model.embed(tokens.long())
    got = run_embed(model, tokens)
    assert torch.equal(bits(got), bits(sequential_embed(model, tokens)))
    assert torch.equal(got, torch.full_like(got, total))
    if min(rows) >= 0:
        assert (bits(got).int() - bits(want).int()).abs().max() <= 1


def test_out_of_range_ids_read_nothing() -> None:
    """Token ids outside [0, V) give zero rows; codes outside [0, codebook_size) add nothing."""
    model = tiny_model(torch.float32, scale=False)
    c = model.config
    tokens = torch.tensor(
        [[-1, 0, 0, 0, 0], [c.vocab_size, 1, 1, 1, 1], [c.semantic_begin_id, -1, 5, c.codebook_size, 7]],
        dtype=torch.int32,
    )
    got = run_embed(model, tokens)
    assert not got[:2].any()
    emb, cb = model.embeddings.weight.detach(), model.codebook_embeddings.weight.detach()
    size = c.codebook_size
    assert torch.equal(got[2], emb[c.semantic_begin_id] + (cb[5 + size] + cb[7 + 3 * size]))


def torch_fast_pass0(frames: Tensor, hidden: Tensor, table: Tensor, begin: int, size: int) -> Tensor:
    """The torch lines the kernel replaces (`frames` is updated in place)."""
    code0 = torch.clamp(frames[:, 0].long() - begin, 0, size - 1)
    frames[:, 1].copy_(code0)
    return torch.stack([hidden, table[code0]], dim=1).reshape(2 * hidden.shape[0], hidden.shape[1])


@pytest.mark.parametrize("dim", [64, BLOCK_D + 96])
def test_fast_pass0_input_equals_torch(dim: int) -> None:
    """frames and hidden as strided views, main tokens below, inside and above the semantic
    range (clamped); frames[:, 1] written, the other columns kept, out poisoned first."""
    gen = torch.Generator().manual_seed(dim)
    begin, size, batch = 400, 64, 9
    table = torch.randn(size, dim, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(batch, dim + 8, generator=gen).to(torch.bfloat16)[:, 4 : dim + 4]
    frames = torch.randint(-5, 1000, (batch, 13), generator=gen, dtype=torch.int32)[:, 1:12]
    frames[:4, 0] = torch.tensor([0, begin - 1, begin, begin + size], dtype=torch.int32)
    expected_frames = frames.clone()
    want = torch_fast_pass0(expected_frames, hidden, table, begin, size)
    out = torch.full((2 * batch, dim), float("nan"), dtype=torch.bfloat16)
    assert fast_pass0_input(frames, hidden, table, begin, size, out) is out
    assert torch.equal(bits(out), bits(want)) and torch.equal(frames, expected_frames)
    frames[:, 1] = -1
    assert torch.equal(fast_pass0_input(frames, hidden, table, begin, size), want)
    assert torch.equal(frames, expected_frames)


def test_bad_inputs_are_refused() -> None:
    model = tiny_model(torch.bfloat16)
    emb, cb = model.embeddings.weight, model.codebook_embeddings.weight
    tokens = torch.zeros(3, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="tokens must be int32/int64"):
        embed_tokens(tokens.float(), emb, cb, 64, 400, 463, True)
    with pytest.raises(ValueError, match="embeddings must be a 2-D floating table"):
        embed_tokens(tokens, emb.t(), cb, 64, 400, 463, True)
    with pytest.raises(ValueError, match="codebook_embeddings must be"):
        embed_tokens(tokens[:, :4], emb, cb, 64, 400, 463, True)
    with pytest.raises(ValueError, match="one dtype"):
        embed_tokens(tokens, emb, cb.float(), 64, 400, 463, True)
    with pytest.raises(ValueError, match="out must be"):
        embed_tokens(tokens, emb, cb, 64, 400, 463, True, out=torch.zeros(3, 64))
    assert embed_tokens(tokens[:0], emb, cb, 64, 400, 463, True).shape == (0, 64)

    table, hidden = emb[:64], torch.zeros(3, 64, dtype=torch.bfloat16)
    frames, out = torch.zeros(3, 5, dtype=torch.int32), torch.zeros(6, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="frames must be int32"):
        fast_pass0_input(frames.long(), hidden, table, 400, 64, out)
    with pytest.raises(ValueError, match="codebook_size=32 rows"):
        fast_pass0_input(frames, hidden, table, 400, 32, out)
    with pytest.raises(ValueError, match="hidden must be"):
        fast_pass0_input(frames, hidden.float(), table, 400, 64, out)
    with pytest.raises(ValueError, match="out must be"):
        fast_pass0_input(frames, hidden, table, 400, 64, out[:3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_embed_in_a_graph_behind_the_writer_gpu() -> None:
    """Captured in a CUDA graph behind the copy that writes the tokens: each replay embeds the
    tokens of that replay, as `model.embed` does on the GPU."""
    model = tiny_model(torch.bfloat16, dim=2560).to(DEVICE)
    source = random_tokens(model, 64, seed=0).to(DEVICE)
    tokens = torch.zeros_like(source)
    out = torch.empty(64, 2560, dtype=torch.bfloat16, device=DEVICE)

    def step() -> None:
        tokens.copy_(source)
        run_embed(model, tokens, out=out)

    graph = capture_graph(step)  # warm-up calls outside the capture
    for seed in range(1, 4):
        source.copy_(random_tokens(model, 64, seed=seed))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            assert torch.equal(out, model.embed(source.long()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_pass0_in_a_graph_behind_the_writer_gpu() -> None:
    """Captured behind the copies that write frames[:, 0] and hidden: each replay uses them."""
    begin, size, batch, dim = 400, 4096, 64, 2560
    table = torch.randn(size, dim, device=DEVICE).to(torch.bfloat16)
    source = torch.zeros(batch, 11, dtype=torch.int32, device=DEVICE)
    hidden_source = torch.zeros(batch, dim, dtype=torch.bfloat16, device=DEVICE)
    frames, hidden = torch.zeros_like(source), torch.zeros_like(hidden_source)
    out = torch.empty(2 * batch, dim, dtype=torch.bfloat16, device=DEVICE)

    def step() -> None:
        frames.copy_(source)
        hidden.copy_(hidden_source)
        fast_pass0_input(frames, hidden, table, begin, size, out)

    graph = capture_graph(step)  # warm-up calls outside the capture
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        source.copy_(torch.randint(0, begin + size + 100, source.shape, generator=gen))
        hidden_source.copy_(torch.randn(batch, dim, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        expected_frames = source.clone()
        assert torch.equal(out, torch_fast_pass0(expected_frames, hidden_source, table, begin, size))
        assert torch.equal(frames, expected_frames)
