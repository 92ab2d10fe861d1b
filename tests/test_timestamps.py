"""`POST /v1/tts/stream/with-timestamp` on a real `shoal serve` (the demo checkpoint): the events'
audio is `/v1/tts`'s file, the text chunks are the engine's batches timed end to end, and with
`--aligner` (a tiny random-weight wav2vec2 CTC model written here) every chunk gets word timings
inside its span; without one, chunk timings only. Also the timer a live session would reuse."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_process import REPO, ShoalServer
from test_alignment import write_tiny_ctc_aligner

from shoal.engine.api import AudioChunk
from shoal.models.prompt import split_text
from shoal.server.alignment import load_aligner, spoken_words
from shoal.server.timestamps import SegmentTimer

pytestmark = pytest.mark.slow
ROUTE = "/v1/tts/stream/with-timestamp"
SAMPLE_RATE = 44100  # the demo codec's
CHUNK_LENGTH = 100
# Two speaker turns over CHUNK_LENGTH bytes together: the S2 engine speaks them as two batches.
TEXT = (
    "<|speaker:0|>Hello there, my friend.<|speaker:1|>Nice to meet you again; "
    "shall we talk about the weather today?"
)
EVENT_KEYS = {"audio_base64", "content", "chunk_seq", "chunk_audio_offset_sec", "alignment"}
TOLERANCE = 2e-6  # the event times are rounded to microseconds


@pytest.fixture(scope="module")
def aligner_dir(tmp_path_factory) -> Path:
    return write_tiny_ctc_aligner(tmp_path_factory.mktemp("aligner"))


@pytest.fixture(scope="module")
def aligned_server(tmp_path_factory, aligner_dir: Path) -> ShoalServer:
    with ShoalServer.start(
        tmp_path_factory.mktemp("shoal-timestamps"), "--aligner", str(aligner_dir)
    ) as running:
        yield running


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory) -> ShoalServer:
    """No aligner, and the engine in a process of its own (the GPU layout): the chunks' segment
    fields cross the process boundary."""
    with ShoalServer.start(tmp_path_factory.mktemp("shoal-timestamps-plain"), api_workers=1) as running:
        yield running


def request_body(format: str = "pcm") -> dict:
    return {"text": TEXT, "format": format, "seed": 7, "chunk_length": CHUNK_LENGTH}


def timestamped(server: ShoalServer, body: dict) -> tuple[bytes, list[dict]]:
    """The concatenated audio and every event, parsed from the SSE stream as a client would."""
    events = []
    headers = {"Authorization": f"Bearer {server.key_a}"}
    with httpx.stream("POST", server.url + ROUTE, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
            else:
                assert line == "", line
    audio = b"".join(base64.b64decode(event["audio_base64"]) for event in events)
    return audio, events


def tts_audio(server: ShoalServer, body: dict) -> bytes:
    headers = {"Authorization": f"Bearer {server.key_a}"}
    response = httpx.post(server.url + "/v1/tts", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.content


def final_chunks(events: list[dict]) -> list[dict]:
    """Per chunk_seq, the latest non-null alignment with its chunk's fields (Fish's latest-wins)."""
    latest: dict[int, dict] = {}
    for event in events:
        assert set(event) == EVENT_KEYS, event.keys()
        if event["alignment"] is not None:
            latest[event["chunk_seq"]] = event
    return [latest[seq] for seq in sorted(latest)]


def assert_chunks_time_the_audio(chunks: list[dict], audio_seconds: float) -> None:
    """The chunks are the engine's batches in order, each starting where the one before ends,
    together as long as the audio."""
    assert [chunk["chunk_seq"] for chunk in chunks] == list(range(len(chunks)))
    assert [chunk["content"] for chunk in chunks] == split_text(TEXT, CHUNK_LENGTH, "s2")
    assert len(chunks) == 2
    end = 0.0
    for chunk in chunks:
        assert chunk["chunk_audio_offset_sec"] == pytest.approx(end, abs=TOLERANCE)
        assert chunk["alignment"]["audio_duration"] > 0
        end = chunk["chunk_audio_offset_sec"] + chunk["alignment"]["audio_duration"]
    assert end == pytest.approx(audio_seconds, abs=TOLERANCE)


def test_the_stream_carries_tts_audio_and_word_timings_per_chunk(aligned_server: ShoalServer) -> None:
    audio, events = timestamped(aligned_server, request_body("pcm"))
    assert audio == tts_audio(aligned_server, request_body("pcm"))  # same seed, same file
    chunks = final_chunks(events)
    assert_chunks_time_the_audio(chunks, len(audio) / 2 / SAMPLE_RATE)
    for chunk in chunks:
        alignment = chunk["alignment"]
        assert alignment["unit"] == "word"
        words = alignment["segments"]
        assert [word["text"] for word in words] == spoken_words(chunk["content"])
        previous_end = 0.0
        for word in words:  # random weights: where the words fall means nothing, their order does
            assert previous_end - TOLERANCE <= word["start"] <= word["end"]
            assert word["end"] <= alignment["audio_duration"] + TOLERANCE
            previous_end = word["end"]


def test_audio_events_name_their_chunk_in_order_and_never_undo_its_words(aligned_server: ShoalServer) -> None:
    _, events = timestamped(aligned_server, request_body("wav"))
    seqs = [event["chunk_seq"] for event in events if event["audio_base64"]]
    assert seqs == sorted(seqs) and seqs[0] == 0
    words_seen: set[int] = set()
    for event in events:
        alignment = event["alignment"]
        if alignment is None:
            continue
        if alignment["unit"] == "word":
            words_seen.add(event["chunk_seq"])
        else:  # a growing chunk-level snapshot never follows the chunk's word snapshot
            assert event["chunk_seq"] not in words_seen
            assert alignment["segments"] == [
                {"text": event["content"], "start": 0.0, "end": alignment["audio_duration"]}
            ]
    assert words_seen == {0, 1}


def test_without_an_aligner_the_chunks_are_timed_alone(plain_server: ShoalServer) -> None:
    audio, events = timestamped(plain_server, request_body("wav"))
    assert audio == tts_audio(plain_server, request_body("wav"))
    chunks = final_chunks(events)
    assert_chunks_time_the_audio(chunks, (len(audio) - 44) / 2 / SAMPLE_RATE)  # the wav header is 44 bytes
    for chunk in chunks:
        alignment = chunk["alignment"]
        assert alignment["unit"] == "chunk"
        assert alignment["segments"] == [
            {"text": chunk["content"], "start": 0.0, "end": alignment["audio_duration"]}
        ]


def test_times_follow_the_speed_change(aligned_server: ShoalServer) -> None:
    audio, events = timestamped(aligned_server, {**request_body("pcm"), "prosody": {"speed": 2.0}})
    chunks = final_chunks(events)
    end = chunks[-1]["chunk_audio_offset_sec"] + chunks[-1]["alignment"]["audio_duration"]
    assert end == pytest.approx(len(audio) / 2 / SAMPLE_RATE, abs=0.02)  # atempo's framing: a few ms
    assert chunks[1]["chunk_audio_offset_sec"] == pytest.approx(chunks[0]["alignment"]["audio_duration"])


def test_a_client_that_leaves_mid_stream_frees_its_request(aligned_server: ShoalServer) -> None:
    headers = {"Authorization": f"Bearer {aligned_server.key_a}"}
    with httpx.stream(
        "POST", aligned_server.url + ROUTE, json=request_body(), headers=headers, timeout=120
    ) as response:
        assert next(response.iter_lines()).startswith("data: ")
    aligned_server.wait_healthy()  # no running request, stream slot or KV page left behind


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"text": "   ", "format": "pcm"}, 400, "text is empty"),
        ({"text": "Hello.", "reference_id": "no-such-voice"}, 404, "no-such-voice"),
        ({"text": "Hello.", "format": "flac"}, 422, "format"),
    ],
)
def test_bad_requests_get_fish_errors(
    aligned_server: ShoalServer, body: dict, status: int, message: str
) -> None:
    headers = {"Authorization": f"Bearer {aligned_server.key_a}"}
    response = httpx.post(aligned_server.url + ROUTE, json=body, headers=headers, timeout=60)
    assert response.status_code == status
    error = response.json()
    assert set(error) == {"status", "message"} and error["status"] == status
    assert message in error["message"]


def test_a_request_without_a_key_is_refused(aligned_server: ShoalServer) -> None:
    response = httpx.post(aligned_server.url + ROUTE, json={"text": "Hello."}, timeout=60)
    assert response.status_code == 401 and set(response.json()) == {"status", "message"}


def serve_exit(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`shoal serve` with these options; the options are checked before the checkpoint is read."""
    command = [sys.executable, "-m", "shoal.cli", "serve", "--checkpoint", str(tmp_path / "unread"), *args]
    environment = os.environ | (env or {})
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, env=environment)


def test_a_bad_aligner_path_stops_the_server_before_it_starts(tmp_path: Path) -> None:
    missing = serve_exit(tmp_path, "--aligner", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert "--aligner" in missing.stderr and "is not a directory" in missing.stderr
    (tmp_path / "not-a-model").mkdir()
    from_env = serve_exit(tmp_path, env={"SHOAL_ALIGNER": str(tmp_path / "not-a-model")})
    assert from_env.returncode == 2 and "has no config.json or vocab.json" in from_env.stderr


def chunk(segment: int, seconds: float, text: str) -> AudioChunk:
    return AudioChunk(np.zeros(round(seconds * 100), np.float32), 100, None, segment, text)


def test_the_timer_numbers_and_times_chunks_across_a_sessions_requests() -> None:
    """What a live session does: requests in a row on one timer; speed 2 halves every time."""
    timer = SegmentTimer(speed=2.0)
    timer.record(chunk(0, 0.5, "one"))
    timer.record(chunk(0, 0.5, "one"))
    assert timer.completed() == []  # chunk 0 may still grow
    assert timer.audio_fields()["alignment"]["audio_duration"] == 0.5
    timer.record(chunk(1, 1.0, "two"))
    assert [final["content"] for final in timer.completed()] == ["one"]  # the next batch started
    timer.end_request()
    timer.record(chunk(0, 2.0, "three"))  # a new request starts again at segment 0
    timer.end_request(spoken=False)  # cut short by a barge-in
    finals = timer.completed()
    assert [(f["chunk_seq"], f["content"], f["chunk_audio_offset_sec"]) for f in finals] == [
        (1, "two", 0.5),
        (2, "three", 1.0),
    ]
    assert [f["alignment"]["audio_duration"] for f in finals] == [0.5, 1.0]
    assert all(f["alignment"]["unit"] == "chunk" for f in finals)
    assert timer.completed() == []  # each final snapshot is handed out once
    assert timer.audio_fields()["chunk_seq"] == 2


def test_the_timer_aligns_the_words_of_spoken_chunks_only(aligner_dir: Path) -> None:
    aligner = load_aligner(aligner_dir)
    noise = np.random.default_rng(3).standard_normal(SAMPLE_RATE).astype(np.float32) * 0.1

    async def session() -> list[dict]:
        """As a live session would: a task forwards each final snapshot as soon as it is ready."""
        timer, sent = SegmentTimer(aligner), []

        async def send(fields: dict) -> None:
            sent.append(fields)

        forwarder = asyncio.create_task(timer.forward(send))
        timer.record(AudioChunk(noise, SAMPLE_RATE, None, 0, "<|speaker:0|>Hello there."))
        timer.end_request()
        timer.record(AudioChunk(noise, SAMPLE_RATE, None, 0, "Cut short here."))
        timer.end_request(spoken=False)
        await asyncio.wait_for(timer.finish(), timeout=30)
        await asyncio.wait_for(forwarder, timeout=1)  # it ends once everything is sent
        return sent

    finals = asyncio.run(session())
    assert [final["alignment"]["unit"] for final in finals] == ["word", "chunk"]
    assert [word["text"] for word in finals[0]["alignment"]["segments"]] == ["Hello", "there."]
    assert finals[1]["chunk_audio_offset_sec"] == 1.0


def test_the_live_socket_sends_alignment_events_when_asked(aligned_server: ShoalServer) -> None:
    """`start` with `"alignment": true`: each spoken text batch's final snapshot (with the
    aligner's words) comes as an `alignment` event before `finish`; without it, none."""
    import ormsgpack
    from websockets.sync.client import connect

    url = aligned_server.url.replace("http://", "ws://") + "/v1/tts/live"
    headers = {"Authorization": f"Bearer {aligned_server.key_a}"}
    for asked in (True, False):
        with connect(url, additional_headers=headers) as socket:
            start = {"event": "start", "request": {**request_body(), "text": ""}, "alignment": asked}
            socket.send(ormsgpack.packb(start))
            socket.send(ormsgpack.packb({"event": "text", "text": TEXT}))
            socket.send(ormsgpack.packb({"event": "stop"}))
            events = []
            while not events or events[-1]["event"] != "finish":
                events.append(ormsgpack.unpackb(socket.recv(timeout=120)))
        assert events[-1]["reason"] == "stop", events[-1]
        alignments = [e for e in events if e["event"] == "alignment"]
        if not asked:
            assert not alignments
            continue
        sequence = [e["chunk_seq"] for e in alignments]
        assert sequence and sequence == sorted(sequence)
        audio_seconds = sum(len(e["audio"]) for e in events if e["event"] == "audio") / 2 / 44100
        last = alignments[-1]
        end = last["chunk_audio_offset_sec"] + last["alignment"]["audio_duration"]
        assert end == pytest.approx(audio_seconds, abs=0.01)
        for event in alignments:
            segments = event["alignment"]["segments"]
            assert segments and all(0 <= s["start"] <= s["end"] for s in segments)
