"""`/v1/tts/live` sessions that outlive an utterance, on a real server (the demo checkpoint):
sessions one after another on one socket, several utterances per session on one voice prefill,
and Shoal's barge-in (`cancel` -> `cancelled`), which aborts the engine request at once, frees its
KV pages and lets the session go on. Against `shoal serve` split into an engine process and two
API processes, plus an app in this process where the test sees the engine."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import ormsgpack
import pytest
from server_process import MAX_NEW_FRAMES, ShoalServer, app_in_thread, demo_checkpoint, wav_clip
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

pytestmark = pytest.mark.slow
# 20 speaker turns of about 60 bytes: with chunk_length=100, S2 synthesizes them as 20 batches.
LONG_TEXT = "".join(
    f"<|speaker:{i % 2}|>Some text that takes a while to speak, turn {i}. " for i in range(20)
)
PCM = {"text": "", "format": "pcm", "chunk_length": 100, "seed": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ShoalServer:
    """The split server (the default layout); the engine-in-process path is the `in_process` app's
    below, and the one-process server's live sessions are LiveKit's and Pipecat's tests'."""
    with ShoalServer.start(tmp_path_factory.mktemp("shoal-live"), api_workers=2) as running:
        yield running


@contextmanager
def live(url: str, key: str | None = None) -> Iterator[ClientConnection]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with connect(url.replace("http://", "ws://") + "/v1/tts/live", additional_headers=headers) as socket:
        yield socket


def send(socket: ClientConnection, event: str, **fields) -> None:
    socket.send(ormsgpack.packb({"event": event, **fields}))


def receive(socket: ClientConnection, timeout: float = 60) -> dict:
    return ormsgpack.unpackb(socket.recv(timeout=timeout))


def until(socket: ClientConnection, event: str, timeout: float = 120) -> list[dict]:
    """Every event up to and including the first `event` (a `finish` ends it in any case)."""
    events = [receive(socket, timeout)]
    while events[-1]["event"] not in (event, "finish"):
        events.append(receive(socket, timeout))
    assert events[-1]["event"] == event, events[-1]
    return events


def audio_of(events: list[dict]) -> bytes:
    return b"".join(event["audio"] for event in events if event["event"] == "audio")


def health(url: str) -> dict:
    return httpx.get(f"{url}/v1/health").json()


def request_pages(state: dict) -> int:
    """KV pages held by requests (cached voice prefixes stay, by design)."""
    return state["pages_used"] - state["prefix_cache_pages"]


def wait_for(url: str, condition, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = health(url)
        if condition(state):
            return state
        time.sleep(0.05)
    raise AssertionError(f"not reached in {timeout} s: {state}")


def engine_idle(state: dict) -> bool:
    return state["running"] == 0 and request_pages(state) == 0


def live_sessions_counted(url: str, status: int) -> float:
    metrics = httpx.get(f"{url}/metrics").text
    match = re.search(rf'shoal_requests_total{{route="/v1/tts/live",status="{status}"}} (\S+)', metrics)
    return float(match.group(1)) if match else 0.0


def speak_utterance(socket: ClientConnection, url: str, text: str) -> bytes:
    """Send one utterance (`text`, `flush`) and collect its audio: until the engine is idle and
    no more arrives."""
    send(socket, "text", text=text)
    send(socket, "flush")
    events = [receive(socket)]
    assert events[0]["event"] == "audio", events[0]
    while True:
        try:
            events.append(receive(socket, timeout=0.5))
            assert events[-1]["event"] == "audio", events[-1]
        except TimeoutError:
            if engine_idle(health(url)):
                return audio_of(events)


def test_sessions_follow_one_another_on_one_socket(server):
    """After `finish`/`stop` the socket stays open: each new `start` is a new session with its own
    encoder (so a wav session starts with its own header), counted once in /metrics."""
    counted = live_sessions_counted(server.url, 101)
    with live(server.url, server.key_a) as socket:
        for index, fmt in enumerate(("wav", "pcm", "wav")):
            send(socket, "start", request={**PCM, "format": fmt})
            send(socket, "text", text=f"Session {index}.")
            send(socket, "stop")
            events = until(socket, "finish")
            assert events[-1] == {"event": "finish", "reason": "stop"}
            data = audio_of(events)
            assert len(data) > 1000 and (data[:4] == b"RIFF") == (fmt == "wav")
            assert data.count(b"RIFF") == (fmt == "wav")
        assert live_sessions_counted(server.url, 101) == counted + 3
        assert health(server.url)["active_streams"] == 1  # the open socket, between sessions
        send(socket, "text", text="no start")
        finish = receive(socket)
        assert finish["reason"] == "error" and "send 'start' first" in finish["message"]
        with pytest.raises(ConnectionClosed):
            receive(socket)
    assert live_sessions_counted(server.url, 400) >= 1


def test_a_session_carries_several_utterances(server):
    """Each `flush` ends an utterance; the session waits for the next one, whose audio continues
    the same file, on the voice prefilled at `start`."""
    files = [("voices", ("clip.wav", wav_clip(), "audio/wav"))]
    headers = {"Authorization": f"Bearer {server.key_a}"}
    created = httpx.post(f"{server.url}/model", data={"title": "v"}, files=files, headers=headers)
    voice = created.json()["_id"]
    before = wait_for(server.url, engine_idle)["prefix_cache_pages"]
    with live(server.url, server.key_a) as socket:
        send(socket, "start", request={**PCM, "reference_id": voice})
        # Prefilled at `start`, before any text.
        prefilled = wait_for(server.url, lambda state: state["prefix_cache_pages"] > before)
        for index in range(3):
            assert len(speak_utterance(socket, server.url, f"Utterance {index}.")) > 1000
            # Its request pages are free; the voice's prefix pages stay cached, and no more came.
            assert health(server.url)["prefix_cache_pages"] == prefilled["prefix_cache_pages"]
        send(socket, "stop")
        assert until(socket, "finish")[-1] == {"event": "finish", "reason": "stop"}
    httpx.delete(f"{server.url}/model/{voice}", headers=headers)


def test_barge_in_stops_the_utterance_and_the_session_goes_on(server):
    wait_for(server.url, engine_idle)
    with live(server.url, server.key_a) as socket:
        send(socket, "start", request=PCM)
        send(socket, "cancel")  # nothing spoken yet: answered at once
        assert receive(socket) == {"event": "cancelled"}
        send(socket, "text", text=LONG_TEXT)
        send(socket, "flush")
        assert receive(socket)["event"] == "audio"
        speed = wait_for(server.url, lambda state: state["running"] and state["frames_per_second"] > 0)
        cancelled_at = time.monotonic()
        send(socket, "cancel")
        late = until(socket, "cancelled")
        answered = time.monotonic() - cancelled_at
        # The engine request is gone and its KV pages are free, while the session stays open.
        state = wait_for(server.url, engine_idle, timeout=5)
        assert state["active_streams"] == 1
        stopped = time.monotonic() - cancelled_at
        # 20 text batches of MAX_NEW_FRAMES each were left (tens of seconds on a CPU): the cancel
        # was answered at once (a few engine steps at most, on a busy machine), and the engine
        # was idle a small part of that time later (/v1/health polled every 50 ms).
        remaining = 20 * MAX_NEW_FRAMES / speed["frames_per_second"]
        assert answered < 2.0 and stopped < remaining / 8, (answered, stopped, remaining)
        # Audio after the cancel: at most what was already on its way (frames of ~2048 samples).
        assert len(audio_of(late)) <= 2 * 8 * 2048 * 2, len(audio_of(late))
        with pytest.raises(TimeoutError):  # nothing of the cancelled utterance follows
            receive(socket, timeout=1.0)
        assert engine_idle(health(server.url))

        # The session goes on: the next text is spoken normally.
        assert len(speak_utterance(socket, server.url, "After the barge-in.")) > 1000

        # A barge-in after `stop` (the whole reply was sent, its audio is still coming): the
        # remaining audio is dropped, then `cancelled` and the session's `finish`.
        send(socket, "text", text=LONG_TEXT)
        send(socket, "stop")
        assert receive(socket)["event"] == "audio"
        send(socket, "cancel")
        tail = until(socket, "cancelled")
        assert receive(socket) == {"event": "finish", "reason": "stop"}
        assert len(audio_of(tail)) <= 2 * 8 * 2048 * 2 + 4096  # (+ the pcm encoder's tail)
        wait_for(server.url, engine_idle, timeout=5)

        # Between sessions a cancel is answered at once, and the next session is served.
        send(socket, "cancel")
        assert receive(socket) == {"event": "cancelled"}
        send(socket, "start", request=PCM)
        send(socket, "text", text="A new session.")
        send(socket, "stop")
        events = until(socket, "finish")
        assert events[-1]["reason"] == "stop" and audio_of(events)
    wait_for(server.url, lambda state: engine_idle(state) and state["active_streams"] == 0)


# ---- in this process: the engine is the test's to look at ------------------------------------

IDLE_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    """(base URL, LocalEngine) of an app on the demo checkpoint, auth off; live sessions idle
    out after IDLE_TIMEOUT seconds."""
    from shoal.config import EngineConfig
    from shoal.engine import load_engine
    from shoal.server.app import create_app
    from shoal.server.settings import ServerSettings
    from shoal.server.store import Store

    workdir = tmp_path_factory.mktemp("live-in-process")
    checkpoint = demo_checkpoint(tmp_path_factory.getbasetemp())
    engine = load_engine(checkpoint, device="cpu", config=EngineConfig(num_pages=512), warmup=False)
    settings = ServerSettings(auth=False, max_new_frames=MAX_NEW_FRAMES, live_idle_timeout=IDLE_TIMEOUT)
    app = create_app(engine, Store.in_directory(workdir), settings)
    with app_in_thread(app) as url:
        yield url, engine


def test_a_voice_is_prefilled_once_per_connection(in_process):
    """Utterances reuse the voice prefilled at `start`; a later session with the same voice does
    not prefill it again, one with another voice does."""
    url, engine = in_process
    prefills = []
    real_prefill = engine.prefill_voice

    async def counting_prefill(references):
        prefills.append(references)
        await real_prefill(references)

    engine.prefill_voice = counting_prefill
    voice = {"references": [{"audio": wav_clip(), "text": "a reference"}]}
    other = {"references": [{"audio": wav_clip(1.5), "text": "another reference"}]}
    try:
        with live(url) as socket:
            send(socket, "start", request={**PCM, **voice})
            for index in range(2):
                assert len(speak_utterance(socket, url, f"Utterance {index}.")) > 1000
            send(socket, "stop")
            until(socket, "finish")
            assert len(prefills) == 1
            for request, prefilled in ((voice, 1), (other, 2)):
                send(socket, "start", request={**PCM, **request})
                send(socket, "text", text="Next session.")
                send(socket, "stop")
                assert audio_of(until(socket, "finish"))
                assert len(prefills) == prefilled
    finally:
        del engine.prefill_voice
    assert engine.stats().prefix_cache_pages > 0


def test_a_cancel_drops_the_queued_and_buffered_text(in_process):
    """Barge-in drops everything not spoken yet: the request being spoken is aborted, a queued
    utterance and buffered text never reach the engine; the next text is spoken as sent."""
    url, engine = in_process
    submitted = []
    real_submit = engine.submit

    def recording_submit(request):
        submitted.append(request.text)
        return real_submit(request)

    engine.submit = recording_submit
    try:
        with live(url) as socket:
            send(socket, "start", request=PCM)
            send(socket, "text", text=LONG_TEXT)
            send(socket, "flush")
            send(socket, "text", text="A queued utterance.")
            send(socket, "flush")
            send(socket, "text", text="Buffered words ")
            assert receive(socket)["event"] == "audio"
            send(socket, "cancel")
            until(socket, "cancelled")
            wait_for(url, engine_idle, timeout=5)
            assert len(speak_utterance(socket, url, "After the barge-in.")) > 1000
            send(socket, "stop")
            assert until(socket, "finish")[-1] == {"event": "finish", "reason": "stop"}
    finally:
        del engine.submit
    assert submitted == [LONG_TEXT, "After the barge-in."]


def test_a_socket_idle_between_sessions_is_closed_quietly(in_process):
    """After a session's `finish`, silence closes the socket with code 1000 and no event (no
    session is there to finish, and a pooling client would read a stale event as its next
    session's); the stream slot is freed and only the finished session is counted."""
    url, _ = in_process
    counted = {status: live_sessions_counted(url, status) for status in (101, 408, 499)}
    with live(url) as socket:
        send(socket, "start", request=PCM)
        send(socket, "stop")
        assert receive(socket) == {"event": "finish", "reason": "stop"}
        quiet_since = time.monotonic()
        with pytest.raises(ConnectionClosed) as closed:
            receive(socket, timeout=IDLE_TIMEOUT + 10)
    assert closed.value.rcvd.code == 1000
    assert time.monotonic() - quiet_since >= IDLE_TIMEOUT - 0.1
    assert health(url)["active_streams"] == 0
    assert live_sessions_counted(url, 101) == counted[101] + 1
    assert (live_sessions_counted(url, 408), live_sessions_counted(url, 499)) == (counted[408], counted[499])
