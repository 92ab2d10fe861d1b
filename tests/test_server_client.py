"""The official `fish-audio-sdk` 1.3.0 clients (new `fishaudio` and legacy `fish_audio_sdk`),
unchanged, against a real `shoal serve` on 127.0.0.1 serving the demo checkpoint: every test
runs against the server in one process and split into an engine process and two API processes
(`--api-workers 2`)."""

from __future__ import annotations

import asyncio
import io
import time
import wave

import fish_audio_sdk as legacy
import httpx
import numpy as np
import ormsgpack
import pytest
from fishaudio import AsyncFishAudio, FishAudio
from fishaudio.core.request_options import RequestOptions
from fishaudio.exceptions import (
    APIError,
    AuthenticationError,
    NotFoundError,
    PermissionError,
    RateLimitError,
    ServerError,
    WebSocketError,
)
from fishaudio.types import FlushEvent, Prosody, ReferenceAudio, TextEvent, TTSConfig
from httpx_ws import WebSocketUpgradeError
from server_process import MAX_NEW_FRAMES, ShoalServer, wav_clip
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from shoal.server import audio

pytestmark = pytest.mark.slow
SHORT = TTSConfig(chunk_length=100, max_new_tokens=24)


# Each test runs on the split server (the default layout); those where the engine's place matters
# (streaming, aborts, live sockets, refusals) also on one process. `SPLIT_ONLY` keeps the rest on
# the split server alone.
SPLIT_ONLY = pytest.mark.parametrize("server", [2], ids=["api-workers-2"], indirect=True)


@pytest.fixture(scope="module", params=[0, 2], ids=["one-process", "api-workers-2"])
def server(request, tmp_path_factory) -> ShoalServer:
    with ShoalServer.start(tmp_path_factory.mktemp("shoal-client"), api_workers=request.param) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> FishAudio:
    return FishAudio(api_key=server.key_a, base_url=server.url)


def request_pages(health: dict) -> int:
    """KV pages held by requests (pinned voice prefixes may stay cached, by design)."""
    return max(0, health["pages_used"] - health["prefix_cache_pages"])


def wait_for_idle(server: ShoalServer, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{server.url}/v1/health").json()
        if request_pages(health) == 0 and health["running"] == 0 and health["active_streams"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"server did not go idle: {health}")


@pytest.mark.parametrize("fmt", ["wav", "pcm", "mp3", "opus"])
def test_convert_every_format(client, fmt):
    config = SHORT.model_copy(update={"format": fmt})
    data = client.tts.convert(text="Hello there.", config=config)
    assert data
    if fmt == "wav":
        with wave.open(io.BytesIO(data)) as reader:
            assert (
                reader.getframerate() == 44100 and reader.getsampwidth() == 2 and reader.getnchannels() == 1
            )
    elif fmt == "pcm":
        assert len(data) % 2 == 0
    else:
        assert len(audio.decode_audio(data, silence_peak_dbfs=-200)) > 0


@SPLIT_ONLY
def test_convert_options_models_and_stream(client, server):
    config = SHORT.model_copy(
        update={
            "format": "wav",
            "sample_rate": 16000,
            "prosody": Prosody(volume=3),
            "top_p": 0.5,
            "temperature": 0.5,
        }
    )
    for model in ("s2-pro", "s1", "speech-1.5", "unknown-model"):
        with pytest.warns(DeprecationWarning) if model == "speech-1.5" else _nothing():
            data = client.tts.convert(text="Hi.", config=config, speed=1.5, latency="normal", model=model)
        with wave.open(io.BytesIO(data)) as reader:
            assert reader.getframerate() == 16000
    streamed = client.tts.stream(text="Streaming.", config=SHORT).collect()
    assert streamed[:3] == b"ID3" or streamed[0] == 0xFF


@SPLIT_ONLY
def test_async_client_convert_and_stream(server):
    async def main() -> tuple[bytes, bytes]:
        client = AsyncFishAudio(api_key=server.key_a, base_url=server.url)
        converted = await client.tts.convert(text="Async.", config=SHORT.model_copy(update={"format": "pcm"}))
        stream = await client.tts.stream(text="Async stream.", config=SHORT)
        return converted, await stream.collect()

    converted, streamed = asyncio.run(main())
    assert converted and streamed


@SPLIT_ONLY
def test_inline_references_and_voice_lifecycle(client, server):
    clip = wav_clip()
    inline = client.tts.convert(
        text="Cloned.", references=[ReferenceAudio(audio=clip, text="a reference")], config=SHORT
    )
    assert inline
    voice = client.voices.create(title="Narrator", voices=[clip], texts=["a reference"], tags=["calm", "en"])
    assert voice.train_mode == "fast" and voice.state == "trained" and voice.author.id
    assert client.tts.convert(text="Stored voice.", reference_id=voice.id, config=SHORT)
    assert client.voices.get(voice.id).title == "Narrator"
    page = client.voices.list(page_size=5, page_number=1, tags=["calm"], self_only=True)
    assert page.total == 1 and page.items[0].id == voice.id
    assert client.voices.list(page_size=5, page_number=2, self_only=True).items == []
    client.voices.update(voice.id, title="Renamed", tags=["q", "r"])
    client.voices.update(voice.id, cover_image=b"\x89PNG fake cover")
    updated = client.voices.get(voice.id)
    assert updated.title == "Renamed" and updated.tags == ["q", "r"] and updated.cover_image

    other = FishAudio(api_key=server.key_b, base_url=server.url)
    with pytest.raises(NotFoundError):
        other.voices.get(voice.id)
    client.voices.update(voice.id, visibility="public")
    assert other.voices.get(voice.id).visibility == "public"
    with pytest.raises(PermissionError):
        other.voices.delete(voice.id)
    client.voices.delete(voice.id)
    with pytest.raises(NotFoundError):
        client.voices.get(voice.id)


def test_legacy_session_streams_incrementally(server):
    session = legacy.Session(server.key_a, base_url=server.url)
    turns = "".join(f"<|speaker:{i % 2}|>Turn {i} for the legacy client. " for i in range(3))
    request = legacy.TTSRequest(text=turns, format="pcm", chunk_length=100)  # 3 batches
    arrivals, chunks = [], []
    started = time.monotonic()
    for chunk in session.tts(request, backend="s1"):
        arrivals.append(time.monotonic() - started)
        chunks.append(chunk)
    assert len([c for c in chunks if c]) >= 3, "audio should arrive in several chunks"
    # Streamed while generated, not buffered: the first audio comes long before the last.
    assert arrivals[-1] - arrivals[0] > 0.5 * arrivals[-1], arrivals

    async def awaitable() -> bytes:
        return b"".join([c async for c in session.tts.awaitable(legacy.TTSRequest(text="Legacy async."))])

    assert asyncio.run(awaitable())


@SPLIT_ONLY
def test_legacy_voices_and_account(server):
    session = legacy.Session(server.key_a, base_url=server.url)
    created = session.create_model(title="Legacy", voices=[wav_clip()], texts=["hello"])
    assert session.get_model(created.id).title == "Legacy"
    assert session.list_models(self_only=True).total >= 1
    session.update_model(created.id, title="Legacy 2")
    session.delete_model(created.id)
    with pytest.raises(legacy.HttpCodeErr) as raised:
        session.get_model(created.id)
    assert raised.value.status == 404
    assert session.get_api_credit().credit > 0
    assert isinstance(session.get_package().finished_at, str)


@SPLIT_ONLY
def test_credit_endpoints(client, server):
    assert client.account.get_credits(check_free_credit=True).credit > 0
    assert client.account.get_package().balance > 0


def test_websocket_live_new_client(client, server):
    chunks = list(client.tts.stream_websocket(iter(["Hello ", "world."]), config=SHORT))
    assert chunks
    events = iter([TextEvent(text="One. "), FlushEvent(), "Two."])
    wav = b"".join(client.tts.stream_websocket(events, config=SHORT.model_copy(update={"format": "wav"})))
    assert wav[:4] == b"RIFF"
    assert list(client.tts.stream_websocket(iter([]), config=SHORT)) == []
    large = wav_clip(seconds=12, rate=48000)  # a start message over websockets' default 1 MiB cap
    assert len(large) > 1_048_576
    cloned = SHORT.model_copy(update={"references": [ReferenceAudio(audio=large, text="long reference")]})
    assert list(client.tts.stream_websocket(iter(["Cloned live."]), config=cloned))

    async def run_async() -> list[bytes]:
        async def texts():
            yield "Async live."

        aclient = AsyncFishAudio(api_key=server.key_a, base_url=server.url)
        return [chunk async for chunk in aclient.tts.stream_websocket(texts(), config=SHORT)]

    assert asyncio.run(run_async())
    wait_for_idle(server)


@SPLIT_ONLY
def test_websocket_live_legacy_client(server):
    request = legacy.TTSRequest(text="", format="pcm", chunk_length=100)
    with legacy.WebSocketSession(server.key_a, base_url=server.url) as session:
        assert b"".join(session.tts(request, iter(["Legacy live."]), backend="s1"))
        assert list(session.tts(request, iter([]))) == []

    async def run_async() -> bytes:
        async def texts():
            yield "Legacy async live."

        async with legacy.AsyncWebSocketSession(server.key_a, base_url=server.url) as session:
            return b"".join([chunk async for chunk in session.tts(request, texts())])

    assert asyncio.run(run_async())


def test_error_classes(client, server):
    with pytest.raises(AuthenticationError):
        FishAudio(api_key="wrong", base_url=server.url).tts.convert(text="x")
    with pytest.raises(legacy.HttpCodeErr) as raised:
        legacy.Session("wrong", base_url=server.url).get_model("x")
    assert raised.value.status == 401
    with pytest.raises(WebSocketUpgradeError):
        list(FishAudio(api_key="wrong", base_url=server.url).tts.stream_websocket(iter(["x"])))
    with pytest.raises(NotFoundError):
        client.tts.convert(text="x", reference_id="no-such-voice")
    with pytest.raises(APIError) as invalid:  # the new client's own check would stop chunk_length=5
        client.tts.convert(text="x", config=SHORT.model_copy(update={"sample_rate": 12345}))
    assert invalid.value.status == 400 and "sample_rate" in invalid.value.message
    with pytest.raises(ServerError):  # /v1/asr is not served: 501, which the client maps to ServerError
        client.asr.transcribe(audio=wav_clip())
    # The engine's batch queue holds BATCH_QUEUE_LIMIT = 0 requests: a batch request overloads it.
    batch = RequestOptions(additional_headers={"x-shoal-priority": "batch"})
    with pytest.raises(ServerError) as overloaded:
        client.tts.convert(text="Bulk work.", config=SHORT, request_options=batch)
    assert overloaded.value.status == 503 and "at capacity" in overloaded.value.message
    with pytest.raises(legacy.HttpCodeErr) as legacy_overloaded:
        b"".join(legacy.Session(server.key_batch, base_url=server.url).tts(legacy.TTSRequest(text="Bulk.")))
    assert legacy_overloaded.value.status == 503
    assert client.tts.convert(text="Standard work still runs.", config=SHORT)
    with pytest.raises(WebSocketError):  # a synthesis error inside a live session: finish/error
        list(client.tts.stream_websocket(iter(["x"]), config=SHORT.model_copy(update={"sample_rate": 12345})))


@SPLIT_ONLY
def test_rate_limit_429(server):
    """The limited key may hold one stream: an open live session (started, not stopped) holds it."""
    limited = FishAudio(api_key=server.key_limited, base_url=server.url)
    headers = {"Authorization": f"Bearer {server.key_limited}"}
    url = server.url.replace("http://", "ws://") + "/v1/tts/live"
    with connect(url, additional_headers=headers) as session:
        session.send(ormsgpack.packb({"event": "start", "request": {"text": "", "format": "pcm"}}))
        with pytest.raises(RateLimitError):
            limited.tts.convert(text="second stream", config=SHORT)
        with pytest.raises(WebSocketUpgradeError) as refused:
            list(limited.tts.stream_websocket(iter(["third"]), config=SHORT))
        assert refused.value.response.status_code == 429
        assert refused.value.response.headers["retry-after"] == "1"  # the handshake's refusal too
        session.send(ormsgpack.packb({"event": "stop"}))
        assert ormsgpack.unpackb(session.recv()) == {"event": "finish", "reason": "stop"}
    wait_for_idle(server)
    assert limited.tts.convert(text="Free again.", config=SHORT)


@SPLIT_ONLY
def test_malformed_and_oversized_bodies_keep_serving(client, server):
    headers = {"Authorization": f"Bearer {server.key_a}"}
    cases = [
        (b"\xc1\xc1", "application/msgpack", 400),
        (b"{", "application/json", 400),
        (ormsgpack.packb({"text": ["not", "a", "string"]}), "application/msgpack", 422),
        (b"x" * (server.max_body_bytes + 1), "application/msgpack", 413),
    ]
    for content, content_type, status in cases:
        response = httpx.post(
            f"{server.url}/v1/tts", content=content, headers={**headers, "Content-Type": content_type}
        )
        assert response.status_code == status
        assert set(response.json()) == {"status", "message"}
    big = [("voices", ("upload", b"\0" * (server.max_upload_bytes + 1), "application/octet-stream"))]
    response = httpx.post(f"{server.url}/model", data={"title": "big"}, files=big, headers=headers)
    assert response.status_code == 413 and set(response.json()) == {"status", "message"}
    url = server.url.replace("http://", "ws://") + "/v1/tts/live"
    oversized = ormsgpack.packb({"event": "start", "request": {"text": "x" * server.max_body_bytes}})
    for message in (
        b"\xc1\xc1",
        ormsgpack.packb(["no", "event"]),
        ormsgpack.packb({"event": "start", "request": 5}),
        oversized,  # over the limit but under the transport's cap (twice it): a finish event says so
    ):
        with connect(url, additional_headers=headers, max_size=None) as session:
            session.send(message)
            finish = ormsgpack.unpackb(session.recv())
            assert finish["event"] == "finish" and finish["reason"] == "error" and finish["message"]
    assert "byte limit" in finish["message"]
    with connect(url, additional_headers=headers) as session:  # over twice the limit: the transport's 1009
        session.send(b"\0" * (2 * server.max_body_bytes + 1))
        with pytest.raises(ConnectionClosed) as closed:
            session.recv()
    assert closed.value.rcvd.code == 1009
    wait_for_idle(server)
    assert client.tts.convert(text="Still serving.", config=SHORT)


# 20 speaker turns of about 60 bytes: with chunk_length=100, S2 synthesizes them as 20 batches.
LONG_TEXT = "".join(
    f"<|speaker:{i % 2}|>Some text that takes a while to speak, turn {i}. " for i in range(20)
)


def health(server: ShoalServer) -> dict:
    return httpx.get(f"{server.url}/v1/health").json()


def wait_until_generating(server: ShoalServer) -> float:
    """Wait until the engine has measured its speed on a running request; its frames/s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = health(server)
        if state["running"] and state["frames_per_second"] > 0:
            return state["frames_per_second"]
        time.sleep(0.05)
    raise AssertionError(f"no request running: {state}")


def assert_aborted_early(server: ShoalServer, frames_per_second: float, baseline: dict) -> None:
    """After the client vanished, the engine is idle long before the request could have ended
    on its own (20 batches of MAX_NEW_FRAMES), and holds no request pages: only cached prefixes."""
    started = time.monotonic()
    wait_for_idle(server)
    remaining_seconds = 20 * MAX_NEW_FRAMES / frames_per_second
    assert time.monotonic() - started < remaining_seconds / 2, (frames_per_second, remaining_seconds)
    after = health(server)
    assert request_pages(after) == request_pages(baseline) == 0, (baseline, after)
    assert (
        after["pages_used"] - baseline["pages_used"]
        == after["prefix_cache_pages"] - baseline["prefix_cache_pages"]
    )


def test_disconnect_mid_stream_frees_pages(client, server):
    wait_for_idle(server)
    baseline = health(server)
    body = ormsgpack.packb({"text": LONG_TEXT, "format": "pcm", "chunk_length": 100, "seed": 3})
    headers = {"Authorization": f"Bearer {server.key_a}", "Content-Type": "application/msgpack"}
    with httpx.stream("POST", f"{server.url}/v1/tts", content=body, headers=headers) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()  # (a dropped iterator would close the response at once)
        assert next(chunks)
        frames_per_second = wait_until_generating(server)
    assert_aborted_early(server, frames_per_second, baseline)
    assert client.tts.convert(text="After the disconnect.", config=SHORT)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "shoal_time_to_first_audio_seconds_count" in metrics and "shoal_kv_pages_used" in metrics


def test_live_disconnect_mid_stream_frees_pages(server):
    wait_for_idle(server)
    baseline = health(server)
    headers = {"Authorization": f"Bearer {server.key_a}"}
    url = server.url.replace("http://", "ws://") + "/v1/tts/live"
    with connect(url, additional_headers=headers) as session:
        request = {"text": "", "format": "pcm", "chunk_length": 100, "seed": 3}
        session.send(ormsgpack.packb({"event": "start", "request": request}))
        session.send(ormsgpack.packb({"event": "text", "text": LONG_TEXT}))
        session.send(ormsgpack.packb({"event": "flush"}))
        assert ormsgpack.unpackb(session.recv())["event"] == "audio"
        frames_per_second = wait_until_generating(server)
    assert_aborted_early(server, frames_per_second, baseline)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@SPLIT_ONLY
def test_openai_compatible_speech(client, server):
    """`POST /v1/audio/speech` as OpenAI-style clients call it: `voice` is a stored voice id."""
    voice = client.voices.create(title="OpenAI voice", voices=[wav_clip()], texts=["a reference"])
    headers = {"Authorization": f"Bearer {server.key_a}"}
    url = f"{server.url}/v1/audio/speech"
    body = {"model": "s2-pro", "input": "Hello from the OpenAI route.", "voice": voice.id}
    response = httpx.post(url, json={**body, "response_format": "wav"}, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    with wave.open(io.BytesIO(response.content)) as reader:
        assert reader.getframerate() == 44100 and reader.getnframes() > 0
    response = httpx.post(
        url, json={**body, "response_format": "mp3", "speed": 1.5}, headers=headers, timeout=120
    )
    assert response.status_code == 200 and response.content
    missing = httpx.post(url, json={**body, "voice": "no-such-voice"}, headers=headers, timeout=30)
    assert missing.status_code == 404 and set(missing.json()) == {"status", "message"}
    invalid = httpx.post(url, json={"voice": voice.id}, headers=headers, timeout=30)
    assert invalid.status_code == 422 and invalid.json()["status"] == 422
    client.voices.delete(voice.id)
    wait_for_idle(server)


@SPLIT_ONLY
def test_shoal_synth_speaks_what_the_server_speaks(server, tmp_path, tmp_path_factory):
    """`shoal synth` runs the server's engine path in process: the same text, voice-less, seed
    and options give the same samples as `/v1/tts`, long text split into the same batches."""
    from server_process import demo_checkpoint

    from shoal.cli import main

    text = "".join(f"<|speaker:{i % 2}|>Turn {i}: synth and the server split it alike. " for i in range(5))
    options = {"seed": 11, "chunk_length": 100, "temperature": 0.7, "top_p": 0.7, "repetition_penalty": 1.2}
    body = {"text": text, "format": "pcm", "max_new_tokens": MAX_NEW_FRAMES, **options}
    headers = {"Authorization": f"Bearer {server.key_a}"}
    response = httpx.post(f"{server.url}/v1/tts", json=body, headers=headers, timeout=300)
    assert response.status_code == 200, response.text
    output = tmp_path / "synth.pcm"
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    checkpoint = str(demo_checkpoint(tmp_path_factory.getbasetemp()))
    argv = ["synth", text, "--checkpoint", checkpoint, "-o", str(output), "--quiet", *flags]
    assert main([*argv, "--max-frames", str(MAX_NEW_FRAMES)]) == 0
    served, synthesized = (
        np.frombuffer(b, "<i2").astype(np.int32) for b in (response.content, output.read_bytes())
    )
    # Three text batches of up to MAX_NEW_FRAMES frames each; the same tokens, and audio equal but
    # for float rounding (the server's codec runs on two threads, this process on one).
    assert MAX_NEW_FRAMES * 2048 < len(served) == len(synthesized)
    assert np.abs(served - synthesized).max() <= 8
