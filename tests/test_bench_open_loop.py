"""`shoal bench serve --arrivals poisson` (the open-loop load generator), `serve_playback` (playable
audio per chunk, underruns) and `shoal.bench.capacity` (the engine alone, in process): the pure
parts on hand-built inputs and the real encoders, then a short run against a real `shoal serve`
process on the demo checkpoint and the capacity on the real demo engine."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict

import httpx
import numpy as np
import pytest
from server_process import ShoalServer, demo_checkpoint

from shoal.bench import capacity, open_loop, serve, serve_playback, server_metrics
from shoal.server import audio

# ---- the schedule ------------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_with_the_right_mean():
    rate, duration = 50.0, 200.0
    arrivals = open_loop.poisson_arrivals(rate, duration, random.Random(7))
    assert arrivals == open_loop.poisson_arrivals(rate, duration, random.Random(7))
    assert arrivals != open_loop.poisson_arrivals(rate, duration, random.Random(8))
    assert all(0 < a < b < duration for a, b in zip(arrivals, arrivals[1:], strict=False))
    expected = rate * duration  # 10,000 arrivals; a Poisson count's standard deviation is 100
    assert abs(len(arrivals) - expected) < 4 * math.sqrt(expected)
    gaps = np.diff([0.0, *arrivals])
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.04)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.06)  # exponential: std = mean


def test_plan_draws_the_mix_it_is_given():
    workload = open_loop.Workload(
        frames=(64, 384), formats={"pcm": 3.0, "mp3": 1.0}, ws_share=0.25, voice_share=0.5, voices=3
    )
    planned = open_loop.plan_requests(workload, rate=40.0, duration=100.0, seed=1)
    assert planned == open_loop.plan_requests(workload, rate=40.0, duration=100.0, seed=1)
    assert planned != open_loop.plan_requests(workload, rate=40.0, duration=100.0, seed=2)
    count = len(planned)
    assert all(64 <= p.frames <= 384 for p in planned)
    assert np.mean([p.frames for p in planned]) == pytest.approx(224, rel=0.03)
    formats = Counter(p.audio_format for p in planned)
    assert set(formats) == {"pcm", "mp3"} and formats["pcm"] / count == pytest.approx(0.75, abs=0.03)
    assert sum(p.transport == "ws" for p in planned) / count == pytest.approx(0.25, abs=0.03)
    voices = Counter(p.voice for p in planned)
    assert voices[None] / count == pytest.approx(0.5, abs=0.03) and set(voices) == {None, 0, 1, 2}
    # the warm-up touches every format, transport and voice once, with the shortest length
    warm = open_loop.warmup_requests(workload)
    assert {(p.audio_format, p.transport) for p in warm} == {
        (f, t) for f in ("pcm", "mp3") for t in ("http", "ws")
    }
    assert {p.voice for p in warm} >= {0, 1, 2} and {p.frames for p in warm} == {64}


def test_option_parsers():
    assert open_loop.frame_range("64-384") == (64, 384) and open_loop.frame_range("256") == (256, 256)
    assert open_loop.format_weights("pcm:2,mp3,opus:0") == {"pcm": 2.0, "mp3": 1.0}
    for bad in ("384-64", "0", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            open_loop.frame_range(bad)
    for bad in ("flac", "pcm:-1", "pcm:0", "pcm:x"):
        with pytest.raises(argparse.ArgumentTypeError):
            open_loop.format_weights(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        open_loop.share("1.5")


# ---- playable audio and underruns --------------------------------------------------------------


def test_playback_without_an_underrun():
    # 0.2 s arrives at 1.0; each later chunk arrives before the audio before it has played out
    arrivals = [1.0, 1.15, 1.30, 1.55]
    seconds = [0.2, 0.2, 0.2, 0.2]
    result = serve_playback.playback(arrivals, seconds)
    assert result == serve_playback.Playback(start=1.0, audio_seconds=0.8, underruns=0, stall_seconds=0.0)


def test_playback_with_a_known_stall():
    # plays 1.0-1.2; the second chunk is 0.1 s late (a stall), so playback resumes at 1.3 and runs
    # to 1.5: the third chunk at 1.45 is in time (its deadline moved with the stall) and plays to
    # 1.7; the fourth, at 1.8, is 0.1 s late again
    arrivals = [1.0, 1.3, 1.45, 1.8]
    seconds = [0.2, 0.2, 0.2, 0.2]
    result = serve_playback.playback(arrivals, seconds)
    assert (result.underruns, result.stall_seconds) == (2, pytest.approx(0.2))
    # chunks without audio (a header, a partial mp3 frame) neither start playback nor stall it
    result = serve_playback.playback([0.5, 1.0, 1.1, 1.3], [0.0, 0.2, 0.0, 0.2])
    assert (result.start, result.underruns, result.stall_seconds) == (1.0, 1, pytest.approx(0.1))
    assert serve_playback.playback([], []).start is None


def test_pcm_and_wav_chunks_count_whole_samples():
    # 3 bytes carry one whole sample; the fourth byte completes the second
    assert serve_playback.pcm_chunk_seconds([3, 1, 4], sample_rate=2) == [0.5, 0.5, 1.0]
    seconds = serve_playback.chunk_seconds("wav", [b"\0" * 40, b"\0" * 8, b"\0" * 10], 2)
    assert seconds == [0.0, 1.0, 2.5]


def encode_in_chunks(audio_format: str, pieces: list[int], rate: int) -> tuple[list[bytes], float]:
    """The server's own streaming encoder, fed noise in pieces of these sample counts."""
    encoder = audio.create_encoder(audio_format, input_sample_rate=44100, sample_rate=rate)
    rng = np.random.default_rng(0)
    chunks = [encoder.write((0.3 * rng.standard_normal(n)).astype(np.float32)) for n in pieces]
    chunks.append(encoder.finish())
    return [c for c in chunks if c], sum(pieces) / 44100


@pytest.mark.parametrize("audio_format, rate", [("mp3", 44100), ("opus", 48000)])
def test_compressed_chunks_add_up_to_the_audio_encoded(audio_format, rate):
    chunks, encoded_seconds = encode_in_chunks(audio_format, [8192, 8192, 16384, 16384, 6000], rate)
    seconds = serve_playback.chunk_seconds(audio_format, chunks, rate)
    assert len(seconds) == len(chunks) and all(s >= 0 for s in seconds)
    assert sum(seconds[:-1]) > 0.5 * encoded_seconds  # audio is playable while the stream runs
    decoded = len(audio.decode_audio(b"".join(chunks), sample_rate=rate, silence_peak_dbfs=-200)) / rate
    if audio_format == "opus":  # the Ogg granules are the decoder's own count (end trimming included)
        assert sum(seconds) == pytest.approx(encoded_seconds, abs=0.001)
        assert sum(seconds) == pytest.approx(decoded, abs=0.001)
    else:  # mp3 adds the encoder's padding, at most 2 frames of 1152 samples
        assert encoded_seconds <= sum(seconds) <= encoded_seconds + 2 * 1152 / rate
        assert sum(seconds) == pytest.approx(decoded, abs=0.001)
    # a chunk split anywhere gives the same total, each part its share
    data = b"".join(chunks)
    pieces = [data[i : i + 700] for i in range(0, len(data), 700)]
    assert sum(serve_playback.chunk_seconds(audio_format, pieces, rate)) == pytest.approx(
        sum(seconds), abs=1e-6
    )


# ---- the search for the sustainable rate -------------------------------------------------------


def result_at(rate: float, ok: bool) -> open_loop.RateResult:
    return open_loop.RateResult(
        rate, 10.0, 10, 10, {}, 0.0, 0.0, 50.0, 90.0, 99.0, 1.0, 21.5, 1.0, 0.0, 0.0, 1.0, 0.0, 0.1, 10.0, ok
    )


@pytest.mark.parametrize("threshold, start", [(11.3, [4.0]), (1.7, [4.0, 8.0]), (40.0, [4.0])])
def test_search_brackets_then_bisects(threshold, start):
    results = [result_at(rate, rate <= threshold) for rate in start]
    tried = list(start)
    while (rate := open_loop.next_rate(results, growth=2.0, precision=0.1, floor=0.01)) is not None:
        assert rate not in tried and len(tried) < 20
        tried.append(rate)
        results.append(result_at(rate, rate <= threshold))
    best = open_loop.highest_sustainable(results)
    assert best is not None and best.rate <= threshold
    failing_above = min(r.rate for r in results if not r.sustainable and r.rate > best.rate)
    assert failing_above / best.rate <= 1.1


def test_search_gives_up_below_the_floor():
    results = [result_at(1.0, False)]
    assert open_loop.next_rate(results, growth=2.0, precision=0.1, floor=0.4) == 0.5
    results.append(result_at(0.5, False))
    assert open_loop.next_rate(results, growth=2.0, precision=0.1, floor=0.4) is None


# ---- against a real server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ShoalServer:
    with ShoalServer.start(tmp_path_factory.mktemp("shoal-open-loop")) as running:
        yield running


def bench_args(server: ShoalServer, key: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    base = ["--url", server.url, "--api-key", key, "--arrivals", "poisson", "--text", "Hello there."]
    base += ["--frames", "8-24", "--warmup", "0", "--timeout", "60", "--ramp-seconds", "0"]
    return parser.parse_args([*base, *extra])


@pytest.mark.slow
def test_open_loop_run_against_the_real_server(server, tmp_path, capsys):
    output, traces_path = tmp_path / "open_loop.json", tmp_path / "traces.jsonl"
    args = bench_args(
        server, server.key_a, "--rate", "2.5", "--duration", "2.5", "--formats", "pcm,wav,mp3,opus",
        "--ws-share", "0.3", "--voices", "1", "--voice-share", "0.5", "--seed", "3",
        "--json", str(output), "--traces", str(traces_path),
    )  # fmt: skip
    planned = open_loop.plan_requests(open_loop.workload_from(args), 2.5, 2.5, seed=3)
    assert len(planned) >= 4  # the seed gives a few requests over both transports and a voice
    assert {p.transport for p in planned} == {"http", "ws"} and any(p.voice == 0 for p in planned)
    assert serve.run(args) == 0
    report = json.loads(output.read_text())
    (rate,) = report["rates"]
    assert rate["sent"] == len(planned)
    assert rate["completed"] + sum(rate["errors"].values()) == rate["sent"]
    assert rate["completed"] >= rate["sent"] - 1  # the demo server on a CPU keeps up with 2.5/s
    assert 0 < rate["first_audio_p50_ms"] <= rate["first_audio_p95_ms"] <= rate["first_audio_p99_ms"]
    assert rate["audio_seconds_per_second"] > 0 and rate["mean_concurrency"] > 0
    assert rate["frames_per_second"] == pytest.approx(
        rate["audio_seconds_per_second"] * 44100 / 2048, rel=0.01
    )
    assert 0 <= rate["underrun_share"] <= 1 and rate["share_503"] == 0
    assert 0 < rate["client_cpu_share"] < 4  # the load generator's own CPU time was counted
    assert "stored voice" in rate["by_kind"]
    traces = [json.loads(line) for line in traces_path.read_text().splitlines()]
    assert len(traces) == rate["sent"]
    for trace in traces:
        if trace["error"]:
            continue
        arrivals = [arrival for arrival, _ in trace["chunks"]]
        audio_seconds = sum(seconds for _, seconds in trace["chunks"])
        assert trace["scheduled"] <= trace["opened"] <= trace["sent"] < arrivals[0] <= trace["finished"]
        assert arrivals == sorted(arrivals)
        # at most the frames asked for (mp3 adds up to 2 frames of padding), at least one frame's worth
        assert 2048 / 44100 <= audio_seconds <= trace["frames"] * 2048 / 44100 + 2 * 1152 / 44100, trace
    printed = capsys.readouterr().out
    assert "first audio ms p50/p95/p99" in printed and "sustainable:" in printed
    # the stored voice was created through the API and deleted after
    voices = httpx.get(
        f"{server.url}/model", params={"self": "true"}, headers={"Authorization": f"Bearer {server.key_a}"}
    )
    assert voices.json()["total"] == 0


@pytest.mark.slow
def test_refusals_are_counted_as_503(server):
    # the batch key's queue holds nothing (server_process.BATCH_QUEUE_LIMIT): every request is a 503
    args = bench_args(
        server, server.key_batch, "--rate", "8", "--duration", "0.5", "--ws-share", "0", "--voices", "0"
    )
    (result,) = asyncio.run(open_loop.sweep(args))
    assert result.sent > 0 and result.completed == 0
    assert result.errors == {"503": result.sent} and result.share_503 == 1.0 == result.error_share
    assert result.first_audio_p95_ms is None and not result.sustainable


@pytest.mark.slow
def test_overload_offers_a_multiple_of_the_sustainable_rate_once(server):
    args = bench_args(
        server, server.key_a, "--rate", "1", "--duration", "1", "--frames", "8", "--ws-share", "0",
        "--voices", "0", "--overload", "2",
    )  # fmt: skip
    workload = open_loop.workload_from(args)

    async def overload(results):
        async with open_loop.http_client(args) as client:
            return await open_loop.run_overload(client, results, workload, [], args, time.perf_counter())

    assert asyncio.run(overload([result_at(1.0, False)])) is None  # nothing sustainable: no run
    result = asyncio.run(overload([result_at(1.0, True), result_at(4.0, False)]))
    assert result.rate == 2.0 and result.sent > 0 and result.completed + result.errors.get("503", 0) > 0
    report = open_loop.report([result_at(1.0, True)], workload, args, result)
    assert report["overload"]["factor"] == 2.0 and report["overload"]["sent"] == result.sent
    assert "overload 2x the sustainable rate: 2.00/s" in capacity.summary_table(report, None)
    # What the server saw in that run, from its /metrics before and after.
    view = result.server
    assert view is not None and view["queue_wait_ms"] is not None and view["delivery_lag_ms"] > 0
    assert 0 < view["engine_first_audio_ms"] < view["server_first_audio_ms"] + 5  # the engine's part
    assert view["engine_underrun_streams"] >= 0 and view["gc_pause_ms"] >= 0
    assert 0 <= view["steps_ahead_share"] <= 1  # the engine's steps were counted

    fixed = bench_args(
        server, server.key_a, "--rate", "1", "--duration", "1", "--frames", "8", "--ws-share", "0",
        "--voices", "0", "--overload-rate", "1.5",
    )  # fmt: skip

    async def at_a_fixed_rate():
        async with open_loop.http_client(fixed) as client:
            return await open_loop.run_overload(
                client, [result_at(1.0, False)], workload, [], fixed, time.perf_counter()
            )

    result = asyncio.run(at_a_fixed_rate())  # runs although nothing was sustainable
    assert result.rate == 1.5 and result.sent > 0
    report = open_loop.report([result_at(1.0, False)], workload, fixed, result)
    assert report["overload"]["factor"] is None
    assert "overload with no sustainable rate found: 1.50/s" in capacity.summary_table(report, None)


def test_server_view_from_two_metrics_pages():
    def page(waits: float, lag_count: float, on_time: float, underruns: float) -> str:
        return "\n".join([
            "# TYPE shoal_queue_wait_seconds histogram",
            f"shoal_queue_wait_seconds_sum {0.02 * waits}",
            f"shoal_queue_wait_seconds_count {waits}",
            "# TYPE shoal_audio_delivery_lag_seconds histogram",
            f'shoal_audio_delivery_lag_seconds_bucket{{le="0.1",route="tts"}} {on_time}',
            f'shoal_audio_delivery_lag_seconds_bucket{{le="0.1",route="live"}} {on_time}',
            f'shoal_audio_delivery_lag_seconds_sum{{route="tts"}} {0.004 * lag_count}',
            f'shoal_audio_delivery_lag_seconds_sum{{route="live"}} {0.006 * lag_count}',
            f'shoal_audio_delivery_lag_seconds_count{{route="tts"}} {lag_count}',
            f'shoal_audio_delivery_lag_seconds_count{{route="live"}} {lag_count}',
            "# TYPE shoal_streams_underrun counter",
            f"shoal_streams_underrun_total {underruns}",
            "",
        ])  # fmt: skip

    before = server_metrics.parse_snapshot(page(10, 100, 100, 1))
    after = server_metrics.parse_snapshot(page(30, 300, 299, 3))
    view = server_metrics.server_view(before, after)
    assert view.queue_wait_ms == 20.0 and view.delivery_lag_ms == 5.0  # both routes' chunks
    assert view.late_delivery_share == pytest.approx(2 / 400) and view.engine_underrun_streams == 2
    assert view.engine_first_audio_ms is None  # nothing counted: no mean
    assert "queue wait 20 ms" in view.line() and "0.50% over 100 ms" in view.line()


# ---- the in-process capacity and the summary ---------------------------------------------------


@pytest.mark.slow
def test_capacity_of_the_demo_engine_and_the_summary(tmp_path_factory):
    from shoal.engine import load_engine

    # no warm-up: the CPU compiles nothing, and the window starts after the clients' first requests
    engine = load_engine(demo_checkpoint(tmp_path_factory.getbasetemp()), device="cpu", warmup=False)
    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    args = parser.parse_args([
        "--checkpoint", "-", "--concurrency", "2", "--frames", "4-8", "--seconds", "2",
        "--warmup-seconds", "0.4", "--voices", "1", "--voice-seconds", "2",
    ])  # fmt: skip

    async def measure() -> capacity.Capacity:
        await engine.start()
        try:
            return await capacity.measure(engine, args)
        finally:
            await engine.stop()

    result = asyncio.run(measure())
    assert result.frames_per_second > 0 and result.requests_finished > 0
    assert result.audio_seconds_per_second * engine.frame_rate == pytest.approx(
        result.frames_per_second, rel=0.01
    )
    assert 1 <= result.frames_per_request <= 8
    # The three are reported rounded (frames per request to 0.1): the identity holds to that.
    assert result.requests_per_second == pytest.approx(
        result.frames_per_second / result.frames_per_request, rel=0.05
    )
    assert 0 < result.first_audio_p50_ms <= result.first_audio_p95_ms
    sustainable = {
        "rate": 2.0,
        "frames_per_second": result.frames_per_second / 2,
        "audio_seconds_per_second": 1.0,
    }
    open_loop_report = {
        "rates": [asdict(result_at(2.0, True)), asdict(result_at(4.0, False))],
        "sustainable": sustainable | {"first_audio_p95_ms": 90.0, "mean_concurrency": 1.0},
        "criteria": "p95 first audio <= 200 ms",
    }
    table = capacity.summary_table(open_loop_report, asdict(result))
    assert "HTTP sustainable / in-process capacity (frames/s): 0.50" in table
    assert "none of the rates tried" in capacity.summary_table({"rates": [], "sustainable": None}, None)
