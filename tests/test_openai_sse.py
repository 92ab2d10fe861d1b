"""OpenAI's streaming speech on `POST /v1/audio/speech`: `stream_format: "sse"` answers with
Server-Sent Events (`speech.audio.delta` with base64 audio, then `speech.audio.done` with the
usage), called with the official `openai` Python client against the real app and engine on the
demo checkpoint, served by uvicorn in this process."""

from __future__ import annotations

import base64
import io
import json
import struct
import wave
from collections.abc import Iterable, Iterator

import httpx
import openai
import pytest
from test_telephony_audio import CODEC_HOP, MAX_FRAMES, DemoServer, demo_server

SAMPLE_BYTES = {"pcm": 2, "mulaw": 1}  # bytes per sample of the headerless formats
RATES = {"pcm": 24000, "mulaw": 8000}  # OpenAI's pcm rate; G.711's


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[DemoServer]:
    with demo_server(tmp_path_factory.mktemp("openai-sse")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: DemoServer) -> openai.OpenAI:
    key = server.headers["Authorization"].removeprefix("Bearer ")
    return openai.OpenAI(api_key=key, base_url=f"{server.url}/v1", max_retries=0, timeout=120)


def parse_sse(chunks: Iterable[bytes]) -> Iterator[tuple[str | None, str]]:
    """(event name, data) per event, as the WHATWG event-stream rules read a byte stream: lines
    end in LF, CR or CRLF; `data:` lines join with LF; a blank line dispatches; `:` is a comment."""
    pending = b""
    name: str | None = None
    data: list[str] = []
    for chunk in chunks:
        pending += chunk
        lines = pending.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        pending = lines.pop()
        for raw in lines:
            line = raw.decode("utf-8")
            if not line:
                if data:
                    yield name, "\n".join(data)
                name, data = None, []
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data":
                data.append(value)
            elif field == "event":
                name = value
    assert not pending and not data, "the stream ended inside an event"


def read_speech_events(response) -> tuple[list[dict], int]:
    """The JSON events of a streamed response, and how many network chunks carried a delta."""
    events, chunks_with_audio = [], 0

    def counted(chunks: Iterable[bytes]) -> Iterator[bytes]:
        nonlocal chunks_with_audio
        for chunk in chunks:
            chunks_with_audio += b"speech.audio.delta" in chunk
            yield chunk

    for name, data in parse_sse(counted(response.iter_bytes())):
        event = json.loads(data)
        assert name in (None, event["type"])
        events.append(event)
    return events, chunks_with_audio


def with_data_size(streamed_wav: bytes) -> bytes:
    """A streamed wav (sizes 0xFFFFFFFF) with its real data size, as the `wave` module needs."""
    assert streamed_wav[:4] == b"RIFF" and streamed_wav[36:40] == b"data"
    return streamed_wav[:40] + struct.pack("<I", len(streamed_wav) - 44) + streamed_wav[44:]


def check_events(events: list[dict]) -> tuple[bytes, int]:
    """OpenAI's shapes: deltas `{type, audio}` then one done `{type, usage}`. Returns the joined
    audio and the usage's output tokens."""
    *deltas, done = events
    assert len(deltas) >= 2
    for delta in deltas:
        assert set(delta) == {"type", "audio"} and delta["type"] == "speech.audio.delta"
    audio = b"".join(base64.b64decode(delta["audio"], validate=True) for delta in deltas)
    assert set(done) == {"type", "usage"} and done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert set(usage) == {"input_tokens", "output_tokens", "total_tokens"}
    assert all(isinstance(value, int) for value in usage.values())
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert 0 < usage["output_tokens"] <= MAX_FRAMES
    return audio, usage["output_tokens"]


@pytest.mark.parametrize("fmt", ["pcm", "mulaw", "wav"])
def test_the_openai_client_streams_speech_events(client: openai.OpenAI, fmt: str) -> None:
    with client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts",
        voice="alloy",
        input="Hello there.",
        instructions="Speak warmly.",  # accepted and ignored: the models take no style prompt
        response_format=fmt,  # type: ignore[arg-type]  # mulaw is Shoal's, not in the client's list
        stream_format="sse",
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        events, chunks_with_audio = read_speech_events(response)
    assert chunks_with_audio >= 2  # sent while generated, not in one piece at the end
    audio, frames = check_events(events)
    if fmt == "wav":  # one streamed wav: its header first, sizes unknown (0xFFFFFFFF)
        assert audio[:4] == b"RIFF" and struct.unpack("<I", audio[40:44])[0] == 0xFFFFFFFF
        with wave.open(io.BytesIO(with_data_size(audio))) as reader:
            assert reader.getframerate() == 44100 and reader.getnframes() == frames * CODEC_HOP
    else:  # the usage counts the model's frames: exactly the audio's length at the output rate
        samples = len(audio) // SAMPLE_BYTES[fmt]
        assert abs(samples - frames * CODEC_HOP * RATES[fmt] / 44100) <= 1


def test_without_sse_the_answer_is_the_bare_file(client: openai.OpenAI) -> None:
    for stream_format in ("audio", None):
        options = {} if stream_format is None else {"stream_format": stream_format}
        speech = client.audio.speech.create(
            model="s2-pro", voice="marin", input="Hello there.", response_format="wav", **options
        )
        assert speech.response.headers["content-type"] == "audio/wav"
        with wave.open(io.BytesIO(with_data_size(speech.content))) as reader:
            assert reader.getframerate() == 44100 and 0 < reader.getnframes() <= MAX_FRAMES * CODEC_HOP


def test_a_bad_stream_format_is_a_422_in_the_fish_error_body(
    client: openai.OpenAI, server: DemoServer
) -> None:
    body = {"model": "s2-pro", "input": "Hello.", "voice": "alloy", "stream_format": "ndjson"}
    reply = httpx.post(f"{server.url}/v1/audio/speech", json=body, headers=server.headers, timeout=30)
    assert reply.status_code == 422 and set(reply.json()) == {"status", "message"}
    assert "stream_format" in reply.json()["message"] and "sse" in reply.json()["message"]
    with pytest.raises(openai.UnprocessableEntityError):
        client.audio.speech.create(
            model="s2-pro",
            voice="alloy",
            input="Hello.",
            stream_format="ndjson",  # type: ignore[arg-type]
        )


def test_errors_before_the_first_audio_are_statuses_not_events(server: DemoServer) -> None:
    body = {"input": "Hello.", "voice": "no-such-voice", "stream_format": "sse"}
    reply = httpx.post(f"{server.url}/v1/audio/speech", json=body, headers=server.headers, timeout=30)
    assert reply.status_code == 404 and reply.headers["content-type"] == "application/json"
    assert set(reply.json()) == {"status", "message"}
    g711_at_16k = {
        "input": "Hello.",
        "response_format": "mulaw",
        "sample_rate": 16000,
        "stream_format": "sse",
    }
    reply = httpx.post(f"{server.url}/v1/audio/speech", json=g711_at_16k, headers=server.headers, timeout=30)
    assert reply.status_code == 400 and "8000" in reply.json()["message"]
