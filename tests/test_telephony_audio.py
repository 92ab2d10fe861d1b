"""Telephone audio (raw G.711 mu-law / A-law at 8 kHz) and resampled PCM on every synthesis
endpoint: `/v1/tts`, OpenAI's `/v1/audio/speech`, the live WebSocket and `/v1/jobs`, served over
real HTTP by uvicorn in this process with the real engine on the demo checkpoint (CPU). The
G.711 bytes are decoded with the ITU-T formulas written here, independently of FFmpeg."""

from __future__ import annotations

import io
import time
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import av
import httpx
import numpy as np
import ormsgpack
import pytest
from server_process import app_in_thread
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from shoal.server import audio
from shoal.server.app import create_app
from shoal.server.auth import hash_api_key
from shoal.server.settings import ServerSettings
from shoal.server.store import Store

KEY = "shoal_telephony_test_key"
MAX_FRAMES = 24  # about 1.1 s of audio per request: a few engine chunks, fast on a CPU
CODEC_HOP = 2048  # samples per frame at 44.1 kHz (the demo codec)
SHORT = {"text": "Hello there.", "seed": 5, "max_new_tokens": MAX_FRAMES, "chunk_length": 100}
G711_DECODED_NAME = {"mulaw": "mulaw", "ulaw": "mulaw", "alaw": "alaw"}


@dataclass
class DemoServer:
    url: str
    frame_rate: float
    headers: dict[str, str]

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no request runs: a request batched with the tail of the one before computes in
        another batch shape, so its float rounding (and audio) may differ in the last bit."""
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.url}/v1/health", timeout=10).json()["running"]:
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.02)

    def post(self, path: str, body: dict, timeout: float = 120) -> httpx.Response:
        self.wait_idle()
        return httpx.post(f"{self.url}{path}", json=body, headers=self.headers, timeout=timeout)

    def chunks(self, path: str, body: dict) -> list[bytes]:
        """The response body as the network delivered it (chunked encoding, not re-joined)."""
        self.wait_idle()
        with httpx.stream("POST", f"{self.url}{path}", json=body, headers=self.headers, timeout=120) as reply:
            assert reply.status_code == 200, reply.read()
            return [chunk for chunk in reply.iter_raw() if chunk]


@contextmanager
def demo_server(workdir: Path) -> Iterator[DemoServer]:
    """The real app and engine (demo checkpoint, CPU) behind uvicorn on a free port."""
    from shoal.demo import write_demo_checkpoint
    from shoal.engine import load_engine

    engine = load_engine(write_demo_checkpoint(workdir / "demo"), device="cpu", dtype="float32")
    store = Store.in_directory(workdir / "data")
    store.add_key(hash_api_key(KEY), tenant="telephony")
    app = create_app(engine, store, ServerSettings(max_new_frames=MAX_FRAMES))
    with app_in_thread(app) as url:
        yield DemoServer(url, engine.frame_rate, {"Authorization": f"Bearer {KEY}"})


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[DemoServer]:
    with demo_server(tmp_path_factory.mktemp("telephony")) as running:
        yield running


# ---- G.711 by the book (ITU-T G.711 expansion to 16-bit linear) --------------------------------


def mulaw_to_linear(codes: np.ndarray) -> np.ndarray:
    inverted = ~codes.astype(np.int64) & 0xFF
    exponent, mantissa = (inverted >> 4) & 7, inverted & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(inverted & 0x80, -magnitude, magnitude)


def alaw_to_linear(codes: np.ndarray) -> np.ndarray:
    toggled = codes.astype(np.int64) ^ 0x55
    exponent, mantissa = (toggled >> 4) & 7, toggled & 0x0F
    segment_start = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108))
    magnitude = segment_start << np.maximum(exponent - 1, 0)
    return np.where(toggled & 0x80, magnitude, -magnitude)


def g711_to_linear(data: bytes, fmt: str) -> np.ndarray:
    codes = np.frombuffer(data, np.uint8)
    return mulaw_to_linear(codes) if G711_DECODED_NAME[fmt] == "mulaw" else alaw_to_linear(codes)


def pcm16(data: bytes) -> np.ndarray:
    assert len(data) % 2 == 0
    return np.frombuffer(data, "<i2").astype(np.int64)


def assert_within_g711_quantization(decoded: np.ndarray, pcm: np.ndarray) -> None:
    """G.711 keeps a sign, a 3-bit segment and a 4-bit mantissa: within 1/16 of the sample plus
    the smallest step (the bound FFmpeg's encoders meet over every 16-bit value)."""
    assert len(decoded) == len(pcm)
    assert np.all(np.abs(decoded - pcm) <= np.abs(pcm) / 16 + 12)


def test_the_g711_formulas_here_agree_with_ffmpeg() -> None:
    """The decoders this file checks the server with are standard G.711: FFmpeg's own decoders
    give the same value for each of the 256 codes."""
    codes = np.arange(256, dtype=np.uint8)
    for fmt, formula in (("mulaw", mulaw_to_linear), ("alaw", alaw_to_linear)):
        decoder = av.CodecContext.create(f"pcm_{fmt}", "r")
        decoder.sample_rate, decoder.layout = 8000, "mono"
        frames = decoder.decode(av.Packet(codes.tobytes()))
        assert np.array_equal(np.concatenate([frame.to_ndarray()[0] for frame in frames]), formula(codes))


# ---- /v1/tts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mulaw", "ulaw", "alaw"])
def test_tts_g711_is_the_8_khz_pcm_of_the_same_request_companded(server: DemoServer, fmt: str) -> None:
    chunks = server.chunks("/v1/tts", {**SHORT, "format": fmt})
    assert len(chunks) >= 2  # streamed while generated, not held to the end
    g711 = b"".join(chunks)
    reply = server.post("/v1/tts", {**SHORT, "format": fmt})
    assert reply.headers["content-type"] == audio.CONTENT_TYPES[G711_DECODED_NAME[fmt]]
    assert reply.content == g711  # the same seed: the same bytes, streamed or read whole
    pcm_8k = pcm16(server.post("/v1/tts", {**SHORT, "format": "pcm", "sample_rate": 8000}).content)
    assert_within_g711_quantization(g711_to_linear(g711, fmt), pcm_8k)
    # One byte per sample at 8 kHz: the model's audio (whole codec frames at 44.1 kHz), resampled.
    model_samples = len(pcm16(server.post("/v1/tts", {**SHORT, "format": "pcm"}).content))
    assert model_samples % CODEC_HOP == 0 and model_samples > 0
    assert abs(len(g711) - model_samples * 8000 / 44100) <= 1


@pytest.mark.parametrize("rate", [8000, 16000, 24000])
def test_tts_pcm_at_telephone_and_voice_rates_is_the_model_audio_resampled(
    server: DemoServer, rate: int
) -> None:
    native = pcm16(server.post("/v1/tts", {**SHORT, "format": "pcm"}).content)
    chunks = server.chunks("/v1/tts", {**SHORT, "format": "pcm", "sample_rate": rate})
    assert len(chunks) >= 2
    resampled = pcm16(b"".join(chunks))
    assert abs(len(resampled) - len(native) * rate / 44100) <= 1
    # The server's bytes are the band-limited resampler's output for the model's audio
    # (test_audio.py checks that resampler with tones), to within rounding of the 16-bit input.
    expected = pcm16(audio.encode_audio(native.astype(np.float32) / 32767, "pcm", sample_rate=rate))
    assert len(expected) == len(resampled) and np.max(np.abs(expected - resampled)) <= 2


def test_wav_at_8_khz_carries_its_rate(server: DemoServer) -> None:
    reply = server.post("/v1/tts", {**SHORT, "format": "wav", "sample_rate": 8000})
    with wave.open(io.BytesIO(reply.content)) as reader:
        assert reader.getframerate() == 8000 and reader.getsampwidth() == 2
    pcm_8k = server.post("/v1/tts", {**SHORT, "format": "pcm", "sample_rate": 8000}).content
    assert reply.content[44:] == pcm_8k


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"format": "gsm"}, 422, ["format", "mulaw", "alaw"]),
        ({"format": "mulaw", "sample_rate": 16000}, 400, ["mulaw", "8000", "16000"]),
        ({"format": "alaw", "sample_rate": 44100}, 400, ["alaw", "8000", "44100"]),
        ({"format": "pcm", "sample_rate": 4000}, 422, ["sample_rate"]),
    ],
)
def test_bad_format_or_rate_is_a_fish_error(server: DemoServer, body: dict, status: int, words: list) -> None:
    for path, request in (("/v1/tts", {**SHORT, **body}), ("/v1/jobs", {**SHORT, **body})):
        reply = server.post(path, request)
        assert reply.status_code == status, reply.text
        error = reply.json()
        assert set(error) == {"status", "message"} and error["status"] == status
        assert all(word in error["message"] for word in words), error["message"]


# ---- OpenAI's /v1/audio/speech ----------------------------------------------------------------


def whole_frames(samples: int, rate: int) -> float:
    """How many codec frames `samples` at `rate` hold (an integer for the model's audio)."""
    return samples * 44100 / rate / CODEC_HOP


@pytest.mark.parametrize("fmt", ["mulaw", "ulaw", "alaw"])
def test_openai_speech_speaks_g711(server: DemoServer, fmt: str) -> None:
    body = {"model": "s2-pro", "input": "Hello there.", "voice": "alloy", "response_format": fmt}
    chunks = server.chunks("/v1/audio/speech", body)
    assert len(chunks) >= 2
    data = b"".join(chunks)
    frames = whole_frames(len(data), 8000)
    assert 0 < frames <= MAX_FRAMES and abs(frames - round(frames)) * CODEC_HOP * 8000 / 44100 <= 1
    decoded = g711_to_linear(data, fmt)
    assert np.abs(decoded).max() > 100  # sound, not a run of silence codes
    reply = server.post("/v1/audio/speech", body)
    assert reply.headers["content-type"] == audio.CONTENT_TYPES[G711_DECODED_NAME[fmt]]


@pytest.mark.parametrize(("sample_rate", "expected"), [(None, 24000), (8000, 8000), (16000, 16000)])
def test_openai_pcm_is_24_khz_as_openai_unless_a_rate_is_asked(
    server: DemoServer, sample_rate: int | None, expected: int
) -> None:
    body = {"model": "s2-pro", "input": "Hello there.", "voice": "alloy", "response_format": "pcm"}
    if sample_rate is not None:
        body["sample_rate"] = sample_rate
    samples = len(pcm16(server.post("/v1/audio/speech", body).content))
    frames = whole_frames(samples, expected)
    assert 0 < frames <= MAX_FRAMES and abs(frames - round(frames)) * CODEC_HOP * expected / 44100 <= 1


def test_openai_speech_refuses_g711_at_another_rate(server: DemoServer) -> None:
    body = {"input": "Hello.", "response_format": "mulaw", "sample_rate": 16000}
    reply = server.post("/v1/audio/speech", body)
    assert reply.status_code == 400 and set(reply.json()) == {"status", "message"}
    assert "8000" in reply.json()["message"]
    unknown = server.post("/v1/audio/speech", {"input": "Hello.", "response_format": "g729"})
    assert unknown.status_code == 422 and "response_format" in unknown.json()["message"]


# ---- the live WebSocket --------------------------------------------------------------------


def live_session(server: DemoServer, request: dict) -> tuple[list[bytes], dict]:
    """`start` with `request` (its text included), `stop`; the audio payloads and the finish."""
    url = server.url.replace("http://", "ws://") + "/v1/tts/live"
    payloads = []
    server.wait_idle()
    with connect(url, additional_headers=server.headers) as websocket:
        websocket.send(ormsgpack.packb({"event": "start", "request": request}))
        try:
            websocket.send(ormsgpack.packb({"event": "stop"}))
        except ConnectionClosed:  # a refused `start` ends the session (its finish is buffered)
            pass
        while True:
            event = ormsgpack.unpackb(websocket.recv(timeout=120))
            if event["event"] != "audio":
                return payloads, event
            payloads.append(event["audio"])


@pytest.mark.parametrize("fmt", ["mulaw", "alaw"])
def test_live_websocket_streams_g711(server: DemoServer, fmt: str) -> None:
    payloads, finish = live_session(server, {**SHORT, "format": fmt})
    assert finish == {"event": "finish", "reason": "stop"}
    assert len(payloads) >= 2
    assert b"".join(payloads) == server.post("/v1/tts", {**SHORT, "format": fmt}).content


def test_live_websocket_streams_resampled_pcm(server: DemoServer) -> None:
    payloads, _ = live_session(server, {**SHORT, "format": "pcm", "sample_rate": 16000})
    assert len(payloads) >= 2
    expected = server.post("/v1/tts", {**SHORT, "format": "pcm", "sample_rate": 16000}).content
    assert b"".join(payloads) == expected


def test_live_websocket_refuses_g711_at_another_rate(server: DemoServer) -> None:
    payloads, finish = live_session(server, {**SHORT, "format": "mulaw", "sample_rate": 24000})
    assert payloads == [] and finish["reason"] == "error" and "8000" in finish["message"]


# ---- bulk jobs -------------------------------------------------------------------------------


def finished_job(server: DemoServer, job_id: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=server.headers, timeout=10).json()
        if job["status"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s: {job}")


@pytest.mark.parametrize("fmt", ["mulaw", "alaw"])
def test_bulk_job_items_are_g711_files(server: DemoServer, fmt: str) -> None:
    created = server.post("/v1/jobs", {**SHORT, "format": fmt})  # `text`: one item, id "0"
    assert created.status_code == 202, created.text
    job = finished_job(server, created.json()["id"])
    assert job["status"] == "done" and job["format"] == fmt, job
    item = httpx.get(f"{server.url}/v1/jobs/{job['id']}/items/0", headers=server.headers, timeout=30)
    assert item.headers["content-type"] == audio.CONTENT_TYPES[fmt]
    assert item.content == server.post("/v1/tts", {**SHORT, "format": fmt}).content
