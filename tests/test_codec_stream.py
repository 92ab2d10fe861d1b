"""Streaming decode equals the full decode; one batched step equals each stream alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shoal.models.codec import Codec, CodecConfig, fold_state_dict, random_state_dict

FRAMES = 40


@pytest.fixture(scope="module")
def codec(golden_dir):
    values = json.loads((golden_dir / "codec_tiny" / "config.json").read_text())
    values["transformer"]["n_layer"] = 2  # stacked windows: the carried KV must chain correctly
    config = CodecConfig.from_dict(values)
    model = Codec(config)
    model.load_state_dict(fold_state_dict(model, random_state_dict(config, seed=3)))
    return model.eval()


def random_codes(codec, frames: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    semantic = torch.randint(0, codec.config.semantic_codebook_size, (1, frames), generator=gen)
    residual = torch.randint(0, codec.config.codebook_size, (codec.num_codebooks - 1, frames), generator=gen)
    return torch.cat([semantic, residual])


def stream_decode(pool, codes_per_stream, schedules):
    """Feed each stream its frames in its own chunk schedule, all streams in the same steps."""
    streams = [pool.open() for _ in codes_per_stream]
    offsets = [0] * len(streams)
    outputs = [[] for _ in streams]
    for step in range(max(len(s) for s in schedules)):
        chunks = []
        for i, schedule in enumerate(schedules):
            take = schedule[step] if step < len(schedule) else 0
            chunks.append(codes_per_stream[i][:, offsets[i] : offsets[i] + take])
            offsets[i] += take
        for i, audio in enumerate(pool.step(streams, chunks)):
            assert audio.shape == (chunks[i].shape[-1] * pool.codec.frame_length,)
            outputs[i].append(audio)
    return streams, [torch.cat(parts) for parts in outputs]


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_streaming_equals_full_decode(codec, chunk):
    codes = random_codes(codec, FRAMES, seed=chunk)
    full = codec.decode(codes)[0, 0]
    schedule = [chunk] * (FRAMES // chunk) + ([FRAMES % chunk] if FRAMES % chunk else [])
    streams, (audio,) = stream_decode(codec.stream_pool(2), [codes], [schedule])
    assert streams[0].frames == FRAMES
    assert audio.shape == full.shape
    torch.testing.assert_close(audio, full, atol=1e-5, rtol=0)


def test_batched_streams_with_different_schedules_equal_each_alone(codec):
    codes = [random_codes(codec, FRAMES, seed=10 + i) for i in range(4)]
    schedules = [
        [1] * FRAMES,
        [3, 3, 7, 0, 7, 1, 7, 7, 5],  # a step with no new frames
        [7] * 5 + [5],
        [20, 2, 18],  # longer than the window in one step
    ]
    pool = codec.stream_pool(8)
    _, batched = stream_decode(pool, codes, schedules)
    for i in range(4):
        full = codec.decode(codes[i])[0, 0]
        torch.testing.assert_close(batched[i], full, atol=1e-5, rtol=0)
        _, (alone,) = stream_decode(codec.stream_pool(1), [codes[i]], [schedules[i]])
        torch.testing.assert_close(batched[i], alone, atol=1e-5, rtol=0)


def test_pool_slots_are_reset_and_bounded(codec):
    pool = codec.stream_pool(1)
    codes = random_codes(codec, 12, seed=7)
    first = pool.open()
    pool.step([first], [random_codes(codec, 9, seed=8)])  # leave state behind in the slot
    with pytest.raises(RuntimeError, match="in use"):
        pool.open()
    first.close()
    second = pool.open()
    (audio,) = pool.step([second], [codes])
    torch.testing.assert_close(audio, codec.decode(codes)[0, 0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        pool.step([second, second], [codes, codes])


@pytest.mark.gpu
def test_full_size_bf16_graph_streaming_matches_fp32_decode():
    """bf16 streaming (graphs and eager) against a true-float32 full decode.

    Why not an element-wise graph-vs-eager tolerance: a step padded to a graph bucket runs other
    shapes than the eager step (batch 3 -> 4 rows, 1 frame -> 4), so cuDNN/cuBLAS run other
    kernels with another accumulation order; each intermediate is then rounded to bf16 (unit
    roundoff u = 2^-9) differently, and ~40 layers carry those one-ulp flips to the output. The
    two bf16 results are then two draws of bf16 noise around the float32 answer, and their
    difference is as large as that noise (seen: max 0.04). So the test checks what is exact and
    bounds the rest by the bf16 noise of the plain (non-streaming) bf16 decode:
      1. at equal shapes graph replay equals eager bit for bit (same kernels, deterministic);
      2. with mixed chunk schedules (padding differs) each path's error against float32 is within
         1.25x the full bf16 decode's own error: streaming in bf16 adds no error of its own;
      3. that bf16 error is within the bf16 budget: relative rms < 5e-2 (bf16-rounded weights alone
         give ~1.1e-2 and the whole bf16 decode ~2.7e-2 on this model).
    """
    from shoal.models.codec import random_codec

    reference = random_codec(seed=0, device="cuda", dtype=torch.float32)
    codec = random_codec(seed=0, device="cuda", dtype=torch.bfloat16)
    codes = [random_codes(reference, 24, seed=20 + i).cuda() for i in range(4)]
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False, deterministic=False):  # no TF32 convs
        full = torch.stack([reference.decode(c)[0, 0] for c in codes])
    full_bf16 = torch.stack([codec.decode(c)[0, 0].float() for c in codes])
    graph_pool = codec.stream_pool(8)
    graph_pool.capture_cuda_graphs(batch_sizes=[2, 4], chunk_frames=[4, 8])

    same = [[4] * 6] * 4  # 4 rows x 4 frames every step: the eager shapes are the graph bucket's
    _, graphed = stream_decode(graph_pool, codes, same)
    _, eager = stream_decode(codec.stream_pool(8), codes, same)
    for g, e in zip(graphed, eager, strict=True):
        assert g.dtype == torch.bfloat16
        assert torch.equal(g, e)

    def rel_rms(audio):
        return ((audio - full).pow(2).mean().sqrt() / full.pow(2).mean().sqrt()).item()

    budget = rel_rms(full_bf16)
    assert budget < 5e-2
    mixed = [[4] * 6, [2, 4, 1, 4, 4, 4, 4, 1], [8, 8, 8], [1, 3, 4, 8, 8]]
    for pool in (graph_pool, codec.stream_pool(8)):
        _, audio = stream_decode(pool, codes, mixed)
        audio = torch.stack(audio).float()
        assert rel_rms(audio) < 1.25 * budget
        assert (audio - full).abs().max() < 0.1


@pytest.mark.gpu
def test_vocoder_codec_calls_do_not_wait_for_the_default_stream(codec):
    """The vocoder decodes on its own CUDA stream: with half a second of work queued on the
    default stream (where the engine's decode steps run), a first chunk's codec call returns long
    before that work ends, and its audio equals the audio decoded on an idle GPU."""
    import copy
    import time

    import numpy as np

    from shoal.engine.vocoder import Vocoder

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gpu_codec = copy.deepcopy(codec).cuda()
    g = torch.Generator().manual_seed(7)
    frames = torch.randint(0, 32, (4, gpu_codec.num_codebooks + 1), generator=g, dtype=torch.int32)
    outputs, seconds = {}, {}
    for busy in (False, True):
        vocoder = Vocoder(gpu_codec, 2, chunk_frames=8, first_chunk_frames=4, max_batch=2)
        assert vocoder.capture_graphs() and vocoder.cuda_stream is not None
        audio: list[np.ndarray] = []
        stream = vocoder.open(lambda samples, _frames, audio=audio: audio.append(samples))
        vocoder.push(stream, frames)  # 4 frames: the first chunk is due
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(int(1e9))  # about 0.5 s of the default stream at ~2 GHz
        start = time.perf_counter()
        while work := vocoder.collect():
            vocoder.decode(work)
        seconds[busy] = time.perf_counter() - start
        still_busy = busy and not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert len(audio) == 1 and audio[0].shape == (4 * gpu_codec.frame_length,)
        outputs[busy] = audio[0]
        if busy:
            assert still_busy, "the default stream's work ended before the codec call returned"
    assert seconds[True] < 0.2, seconds
    assert np.array_equal(outputs[False], outputs[True])


@pytest.mark.gpu
def test_host_read_back_reuses_its_pinned_buffer_and_returns_independent_arrays():
    from shoal.engine.vocoder import HostReadBack

    read_back = HostReadBack()
    first_gpu = torch.arange(1000, dtype=torch.float32, device="cuda")
    first = read_back(first_gpu)
    staging = read_back._staging
    assert staging.is_pinned() and staging.numel() == 1024
    second = read_back(-torch.arange(700, dtype=torch.float32, device="cuda"))
    assert read_back._staging is staging  # fits: reused
    np.testing.assert_array_equal(first, np.arange(1000, dtype=np.float32))  # not overwritten
    np.testing.assert_array_equal(second, -np.arange(700, dtype=np.float32))
    assert not np.shares_memory(first, staging.numpy()) and first.flags.owndata
    read_back(torch.zeros(3000, device="cuda"))
    assert read_back._staging.numel() == 4096  # grown to the next power of two


def test_dilated_convs_as_phases_equal_the_dilated_convs(codec):
    """`Tuning.codec_phase_split_dilations`: each dilated conv as an undilated conv over phases
    gives the dilated conv's output, from a plain input (padded) and from a joined buffer with
    room (no copy), and the whole stream still equals the full decode."""
    from shoal.models.codec_modules import CausalConv1d, StepContext

    conv = CausalConv1d(6, 5, 7, dilation=3, weight_norm=None).double()
    gen = torch.Generator().manual_seed(4)
    for new in (1, 4, 8):
        carried = torch.randn(2, conv.context, 6, generator=gen, dtype=torch.float64)
        x = torch.randn(2, new, 6, generator=gen, dtype=torch.float64)
        valid = torch.tensor([new, max(1, new - 1)])
        expected = conv.step(x, StepContext({"c": carried}, valid), "c", valid)
        conv.phase_split = True
        try:
            plain = conv.step(x, StepContext({"c": carried}, valid), "c", valid)
            ctx = StepContext({"c": carried}, valid)
            joined = ctx.joined("c", new, align=conv.row_alignment(x.device))
            assert joined.stride(0) % (3 * 6) == 0  # rows rounded up: the conv pads nothing
            joined[:, conv.context :] = x
            in_place = conv.step(joined, ctx, "c", valid, joined=True)
        finally:
            conv.phase_split = None
        torch.testing.assert_close(plain, expected, atol=1e-12, rtol=0)
        torch.testing.assert_close(in_place, expected, atol=1e-12, rtol=0)
        reference = StepContext({"c": carried}, valid)
        reference.extend("c", x, valid, dim=1)
        assert torch.equal(ctx.new_states["c"], reference.new_states["c"])  # the same state carried

    dilated = [m for m in codec.modules() if isinstance(m, CausalConv1d) and m.phase_alignment_possible]
    assert dilated  # the tiny codec's residual units are dilated
    # By default (None) the phases run on CUDA only.
    assert all(m.phase_split is None for m in dilated)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert dilated[0].splits_phases(cuda) and not dilated[0].splits_phases(cpu)
    codes = random_codes(codec, FRAMES, seed=11)
    full = codec.decode(codes)[0, 0]
    for module in dilated:
        module.phase_split = True
    try:
        _, (audio,) = stream_decode(codec.stream_pool(2), [codes], [[5, 3, 8, 7, 9, 8]])
    finally:
        for module in dilated:
            module.phase_split = None
    torch.testing.assert_close(audio, full, atol=1e-5, rtol=0)


def test_compiled_transformer_step_equals_the_full_decode(codec, monkeypatch):
    """`Tuning.codec_compile_transformer`: the transformer's streaming step through torch.compile
    still carries the right keys/values (uneven chunks, two streams in one batch)."""
    import dataclasses

    from shoal.models import codec_modules

    monkeypatch.setattr(
        codec_modules, "TUNING", dataclasses.replace(codec_modules.TUNING, codec_compile_transformer=True)
    )
    transformer = codec.quantizer.post_module
    codes = [random_codes(codec, FRAMES, seed=21), random_codes(codec, FRAMES, seed=22)]
    full = [codec.decode(c)[0, 0] for c in codes]
    try:
        _, audio = stream_decode(codec.stream_pool(2), codes, [[5, 3, 8, 7, 9, 8], [8] * 5])
        assert transformer._compiled is not None
    finally:
        transformer._compiled = None
    for got, expected in zip(audio, full, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
