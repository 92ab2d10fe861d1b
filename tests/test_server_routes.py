"""Route logic of the API server, in-process (FastAPI TestClient) over the ToneEngine test double:
request parsing, errors, auth and tenants, voices, live protocol, limits, metrics."""

from __future__ import annotations

import io
import json
import re
import time
import wave
from pathlib import Path

import anyio
import av
import numpy as np
import ormsgpack
import pytest
from fastapi.testclient import TestClient
from server_fakes import ToneEngine
from server_process import PER_ENGINE_METRIC, wav_clip
from starlette.websockets import WebSocketDisconnect

from shoal.server import audio
from shoal.server.app import create_app
from shoal.server.auth import hash_api_key
from shoal.server.live import split_ready_text
from shoal.server.settings import ServerSettings
from shoal.server.store import Store

REPO = Path(__file__).resolve().parents[1]

KEY_A = "shoal_test_key_tenant_a"
KEY_B = "shoal_test_key_tenant_b"


@pytest.fixture()
def engine() -> ToneEngine:
    return ToneEngine()


@pytest.fixture()
def client(tmp_path, engine):
    store = Store.in_directory(tmp_path)
    store.add_key(hash_api_key(KEY_A), tenant="a")
    store.add_key(hash_api_key(KEY_B), tenant="b", max_streams=1)
    settings = ServerSettings(max_body_bytes=2_000_000, max_upload_bytes=1_000_000, max_text_length=500)
    with TestClient(create_app(engine, store, settings)) as test_client:
        test_client.headers["Authorization"] = f"Bearer {KEY_A}"
        yield test_client


def msgpack_post(client: TestClient, body: dict, **kwargs):
    headers = {"Content-Type": "application/msgpack", **kwargs.pop("headers", {})}
    return client.post("/v1/tts", content=ormsgpack.packb(body), headers=headers, **kwargs)


def assert_fish_error(response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"status", "message"} and body["status"] == status
    return body["message"]


def test_tts_wav_msgpack_with_legacy_nulls(client, engine):
    legacy = {"text": "Hello", "sample_rate": None, "reference_id": None, "prosody": None, "format": "wav"}
    response = msgpack_post(client, legacy)
    assert response.status_code == 200 and response.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(response.content)) as reader:
        assert reader.getframerate() == 44100 and reader.getsampwidth() == 2
    assert engine.pages_used == 0


def test_tts_json_pcm_sample_rate_and_options(client, engine):
    body = {"text": "Hi there", "format": "pcm", "sample_rate": 16000, "temperature": 0.0, "top_p": 0.5}
    response = client.post("/v1/tts", json=body, headers={"model": "no-such-model"})
    assert response.status_code == 200
    expected = len("Hi there") * 1600 * 2  # 0.1 s chunks at 16 kHz, s16
    assert abs(len(response.content) - expected) <= 64
    request = engine.submitted[-1]
    assert request.sampling.temperature == pytest.approx(0.1) and request.sampling.top_p == 0.5


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_tts_compressed_formats_decode(client, fmt):
    response = msgpack_post(client, {"text": "abc", "format": fmt, "opus_bitrate": 32, "mp3_bitrate": 64})
    assert response.status_code == 200
    decoded = audio.decode_audio(response.content)
    assert 0.25 < len(decoded) / audio.SAMPLE_RATE < 0.4


def test_prosody_speed_shortens_audio(client):
    plain = msgpack_post(client, {"text": "abcdefgh", "format": "pcm"}).content
    fast = msgpack_post(client, {"text": "abcdefgh", "format": "pcm", "prosody": {"speed": 2.0}}).content
    assert abs(len(fast) / len(plain) - 0.5) < 0.05


@pytest.mark.parametrize(
    ("content", "content_type", "status"),
    [
        (b"\xc1\xc1garbage", "application/msgpack", 400),
        (b"{not json", "application/json", 400),
        (b"[" * 5000 + b"]" * 5000, "application/json", 400),  # nesting past the recursion limit
        (ormsgpack.packb([1, 2]), "application/msgpack", 422),
        (ormsgpack.packb({"text": 5}), "application/msgpack", 422),
        (ormsgpack.packb({"text": "x", "chunk_length": 5}), "application/msgpack", 422),
        (ormsgpack.packb({"text": "x", "format": "flac"}), "application/msgpack", 422),
        (ormsgpack.packb({"text": "   "}), "application/msgpack", 400),
        (ormsgpack.packb({"text": "x" * 501}), "application/msgpack", 413),
        (ormsgpack.packb({"text": "x", "format": "mp3", "sample_rate": 12345}), "application/msgpack", 400),
        (b"x" * 2_000_001, "application/msgpack", 413),
    ],
)
def test_bad_requests_get_fish_errors(client, engine, content, content_type, status):
    response = client.post("/v1/tts", content=content, headers={"Content-Type": content_type})
    assert_fish_error(response, status)
    assert engine.pages_used == 0
    assert msgpack_post(client, {"text": "still serving", "format": "pcm"}).status_code == 200


def test_engine_errors_map_to_statuses(client, engine):
    assert "synthesis failed" in assert_fish_error(msgpack_post(client, {"text": "FAIL"}), 500)
    assert_fish_error(msgpack_post(client, {"text": "INVALID"}), 400)
    engine.max_waiting = 0
    overloaded = msgpack_post(client, {"text": "hello"})
    assert_fish_error(overloaded, 503)
    assert overloaded.headers["retry-after"] == "1"


def test_engine_unavailable_is_a_503_to_retry_everywhere(client, engine):
    """While the engine process is down: 503 with Retry-After in the Fish shape on synthesis
    and health, an error event in a live session, and /metrics says so (`shoal_engine_up 0`)."""
    with client.stream("POST", "/v1/tts", json={"text": "x" * 40, "format": "pcm"}) as streaming:
        assert streaming.status_code == 200
        chunks = streaming.iter_raw()
        received = len(next(chunks))
        engine.unavailable = True  # mid-stream: the body is left unfinished (a truncated response)
        received += sum(len(chunk) for chunk in chunks)
    assert received < 40 * 2 * engine.sample_rate // 10
    for response in (msgpack_post(client, {"text": "hello"}), client.get("/v1/health")):
        assert "unavailable" in assert_fish_error(response, 503)
        assert response.headers["retry-after"] == "5"
    live = [
        {"event": "start", "request": {"format": "pcm"}},
        {"event": "text", "text": "Hi."},
        {"event": "flush"},
    ]
    events = live_session(client, live)
    assert events[-1]["reason"] == "error" and "unavailable" in events[-1]["message"]
    metrics = client.get("/metrics").text
    assert "shoal_engine_up 0.0" in metrics and "shoal_kv_pages_used" not in metrics
    engine.unavailable = False
    assert msgpack_post(client, {"text": "back", "format": "pcm"}).status_code == 200
    assert "shoal_engine_up 1.0" in client.get("/metrics").text


def test_disconnect_before_first_audio_aborts(tmp_path):
    """A client gone while its request still waits for audio (e.g. queued) frees it at once,
    not when the first audio would have come (here after 30 s)."""
    engine = ToneEngine(chunk_delay=30.0)
    app = create_app(engine, Store.in_directory(tmp_path), ServerSettings(auth=False))
    body = ormsgpack.packb({"text": "hello", "format": "pcm"})
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/tts", "raw_path": b"/v1/tts", "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/msgpack")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {},
    }  # fmt: skip
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent = drive_asgi(app, scope, messages, leave_after_s=0.2)  # then the client goes away
    assert len(engine.submitted) == 1 and engine.pages_used == 0 and not engine.running
    assert sent[0]["status"] == 499


def send_half_a_body_then_leave(app, method: str, path: str) -> list[dict]:
    """Drive `app` with a request whose client disconnects halfway through its body."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "state": {}, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
    }  # fmt: skip
    messages = [{"type": "http.request", "body": b'{"text": "hel', "more_body": True}]
    return drive_asgi(app, scope, messages)  # the rest of the body never comes


def drive_asgi(app, scope: dict, messages: list[dict], leave_after_s: float = 0.0) -> list[dict]:
    """Run one ASGI request through `app`: `messages` are received in turn, then (after
    `leave_after_s`) the client disconnects. Returns what the app sent."""
    pending = iter(messages)
    sent: list[dict] = []

    async def receive() -> dict:
        for message in pending:
            return message
        if leave_after_s:
            await anyio.sleep(leave_after_s)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def scenario() -> None:
        with anyio.fail_after(10):
            await app(scope, receive, send)

    anyio.run(scenario)
    return sent


def test_client_gone_while_sending_its_body_is_499_not_an_internal_error(tmp_path):
    engine = ToneEngine()
    app = create_app(engine, Store.in_directory(tmp_path), ServerSettings(auth=False))
    for method, path in (("POST", "/v1/tts"), ("DELETE", "/v1/references/delete")):
        sent = send_half_a_body_then_leave(app, method, path)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    metrics = app.state.metrics.render().decode()
    assert 'status="499"' in metrics and 'status="500"' not in metrics and not engine.submitted


def test_auth_required_and_invalid(client):
    assert_fish_error(client.post("/v1/tts", json={"text": "x"}, headers={"Authorization": ""}), 401)
    message = assert_fish_error(client.get("/model", headers={"Authorization": "Bearer nope"}), 401)
    assert message == "Invalid Token"
    assert client.get("/v1/health", headers={"Authorization": ""}).status_code == 200


def test_unknown_route_and_asr_are_fish_errors(client):
    assert_fish_error(client.get("/v2/nothing"), 404)
    assert_fish_error(client.post("/v1/asr", content=ormsgpack.packb({"audio": b"x"})), 501)


def test_voice_crud_and_tenant_isolation(client, engine):
    files = [("voices", ("upload", wav_clip(), "application/octet-stream"))]
    data = {"title": "Mine", "texts": ["hello there"], "tags": ["a", "b"], "visibility": "private"}
    created = client.post("/model", data=data, files=files)
    assert created.status_code == 201, created.text
    voice = created.json()
    voice_id = voice["_id"]
    assert voice["train_mode"] == "fast" and voice["state"] == "trained" and voice["tags"] == ["a", "b"]
    assert engine.encoded == 1

    other = {"Authorization": f"Bearer {KEY_B}"}
    assert_fish_error(client.get(f"/model/{voice_id}", headers=other), 404)
    assert_fish_error(msgpack_post(client, {"text": "x", "reference_id": voice_id}, headers=other), 404)
    assert client.get("/model", headers=other).json()["total"] == 0

    patched = client.patch(f"/model/{voice_id}", data={"visibility": "public", "title": "Shared"})
    assert patched.status_code == 200 and patched.json()["title"] == "Shared"
    assert client.get(f"/model/{voice_id}", headers=other).status_code == 200
    assert_fish_error(client.delete(f"/model/{voice_id}", headers=other), 403)

    response = msgpack_post(
        client, {"text": "use it", "reference_id": voice_id, "format": "pcm"}, headers=other
    )
    assert response.status_code == 200
    assert engine.submitted[-1].references[0].text == "hello there"

    page = client.get(
        "/model", params={"page_size": 5, "page_number": 1, "tag": ["a"], "self": "true"}
    ).json()
    assert page["total"] == 1 and page["items"][0]["_id"] == voice_id
    assert client.delete(f"/model/{voice_id}").status_code == 200
    assert_fish_error(client.get(f"/model/{voice_id}"), 404)


def test_voice_upload_limits(client):
    too_big = [("voices", ("upload", b"\0" * 1_000_001, "application/octet-stream"))]
    assert_fish_error(client.post("/model", data={"title": "big"}, files=too_big), 413)
    garbage = [("voices", ("upload", b"not audio at all", "application/octet-stream"))]
    assert_fish_error(client.post("/model", data={"title": "bad"}, files=garbage), 400)
    assert_fish_error(client.post("/model", data={"title": "none"}), 422)


def test_inline_references_are_encoded_once(client, engine):
    reference = {"audio": wav_clip(), "text": "ref"}
    for _ in range(2):
        body = {"text": "hello", "format": "pcm", "references": [reference]}
        assert msgpack_post(client, body).status_code == 200
    assert engine.encoded == 1
    first, second = (request.references[0].codes for request in engine.submitted)
    assert np.array_equal(first, second)  # equal references: the engine shares their prefix pages


def test_refused_requests_do_no_voice_work(client, engine):
    """Over-long text is refused before its inline reference clip is decoded and encoded."""
    reference = {"audio": wav_clip(), "text": "ref"}
    assert_fish_error(msgpack_post(client, {"text": "x" * 501, "references": [reference]}), 413)
    assert engine.encoded == 0 and not engine.submitted


def test_fish_speech_reference_routes(client):
    files = {"audio": ("a.wav", wav_clip(), "audio/wav")}
    added = client.post("/v1/references/add?format=json", data={"id": "narrator", "text": "hi"}, files=files)
    assert added.status_code == 200 and added.json()["success"]
    listed = ormsgpack.unpackb(client.get("/v1/references/list").content)
    assert listed["reference_ids"] == ["narrator"]
    renamed = client.post(
        "/v1/references/update", json={"old_reference_id": "narrator", "new_reference_id": "n2"}
    )
    assert renamed.status_code == 200
    assert msgpack_post(client, {"text": "x", "reference_id": "n2", "format": "pcm"}).status_code == 200
    deleted = client.request(
        "DELETE",
        "/v1/references/delete",
        content=json.dumps({"reference_id": "n2"}),
        headers={"Accept": "application/json"},
    )
    assert deleted.status_code == 200
    assert client.get("/v1/references/list?format=json").json()["reference_ids"] == []
    nested = client.request(
        "DELETE", "/v1/references/delete", content=b"[" * 5000, headers={"Content-Type": "application/json"}
    )
    assert_fish_error(nested, 400)


def test_a_reused_voice_name_speaks_its_new_samples_in_every_api_process(client, engine, tmp_path):
    """API processes cache stored voices' codes: one that cached a reference must not speak the
    old samples after another process deleted it and a new reference took the same name."""
    other_engine = ToneEngine()
    with TestClient(create_app(other_engine, Store.in_directory(tmp_path), ServerSettings())) as other:
        other.headers["Authorization"] = f"Bearer {KEY_A}"

        def add(seconds: float) -> None:
            files = {"audio": ("a.wav", wav_clip(seconds), "audio/wav")}
            added = other.post("/v1/references/add?format=json", data={"id": "x", "text": "t"}, files=files)
            assert added.status_code == 200, added.text

        def frames_spoken_with() -> int:
            assert (
                msgpack_post(client, {"text": "x", "reference_id": "x", "format": "pcm"}).status_code == 200
            )
            return engine.submitted[-1].references[0].codes.shape[1]

        add(1.0)
        assert frames_spoken_with() == 21
        deleted = other.request("DELETE", "/v1/references/delete", json={"reference_id": "x"})
        assert deleted.status_code == 200
        add(2.0)
        assert frames_spoken_with() == 43


def test_reference_names_are_per_tenant_with_no_existence_oracle(client, engine):
    """Tenant B cannot tell that A has a private reference named "x" (same answers as for a free
    name), can take the name itself, and each tenant's "x" speaks with its own clip."""
    other = {"Authorization": f"Bearer {KEY_B}"}

    def add(name: str, headers: dict | None = None, seconds: float = 1.0):
        files = {"audio": ("a.wav", wav_clip(seconds), "audio/wav")}
        return client.post("/v1/references/add", data={"id": name}, files=files, headers=headers or {})

    assert add("x").status_code == 200
    assert_fish_error(add("x"), 409)  # a tenant's own names do clash
    for name in ("x", "free"):  # taken by A, or by nobody: B sees the same
        body = {"old_reference_id": name, "new_reference_id": "y"}
        assert_fish_error(client.post("/v1/references/update", json=body, headers=other), 404)
        delete = client.request("DELETE", "/v1/references/delete", json={"reference_id": name}, headers=other)
        assert_fish_error(delete, 404)
        tts = msgpack_post(client, {"text": "hi", "reference_id": name, "format": "pcm"}, headers=other)
        assert_fish_error(tts, 404)
    assert add("x", other, seconds=2.0).status_code == 200  # A's name does not block B's
    listed = client.get("/v1/references/list?format=json", headers=other).json()
    assert listed["reference_ids"] == ["x"]
    assert client.get("/v1/references/list?format=json").json()["reference_ids"] == ["x"]
    engine.submitted.clear()
    for headers in ({}, other):
        assert (
            msgpack_post(
                client, {"text": "hi", "reference_id": "x", "format": "pcm"}, headers=headers
            ).status_code
            == 200
        )
    clip_a, clip_b = (request.references[0].codes for request in engine.submitted[-2:])
    assert clip_a.shape != clip_b.shape  # one second against two: each tenant's own clip
    # B renames its "x"; A's stays
    body = {"old_reference_id": "x", "new_reference_id": "z"}
    assert client.post("/v1/references/update", json=body, headers=other).status_code == 200
    assert client.get("/v1/references/list?format=json", headers=other).json()["reference_ids"] == ["z"]
    assert client.get("/v1/references/list?format=json").json()["reference_ids"] == ["x"]


def test_stream_limit_per_key_gives_429(client):
    other = {"Authorization": f"Bearer {KEY_B}"}
    with client.stream("POST", "/v1/tts", json={"text": "x" * 40, "format": "pcm"}, headers=other) as first:
        assert first.status_code == 200
        refused = client.post("/v1/tts", json={"text": "y"}, headers=other)
        assert_fish_error(refused, 429)
        assert refused.headers["retry-after"] == "1"
    assert client.post("/v1/tts", json={"text": "y", "format": "pcm"}, headers=other).status_code == 200


def test_wallet_health_metrics(client):
    credit = client.get("/wallet/self/api-credit", params={"check_free_credit": "true"}).json()
    assert credit["_id"] and float(credit["credit"]) > 0
    package = client.get("/wallet/self/package").json()
    assert isinstance(package["finished_at"], str) and package["_id"]
    msgpack_post(client, {"text": "abc", "format": "pcm"})
    health = client.get("/v1/health").json()
    assert health["status"] == "ok" and health["pages_used"] == 0
    text = client.get("/metrics").text
    assert 'shoal_requests_total{route="/v1/tts",status="200"}' in text
    assert "shoal_time_to_first_audio_seconds_bucket" in text and "shoal_kv_pages_used 0.0" in text
    # Every metric the docs name is one that /metrics exports (the per-engine series of several
    # engines: tests/test_data_parallel.py).
    names = set(re.findall(r"^# TYPE (\w+) ", text, re.MULTILINE))
    for doc in ("deployment.md", "api.md"):
        documented = set(re.findall(r"`(shoal_\w+)", (REPO / "docs" / doc).read_text()))
        documented = {name for name in documented if not PER_ENGINE_METRIC.match(name)}
        assert documented and documented <= names, (doc, documented - names)


def live_session(client: TestClient, events: list[dict], headers: dict | None = None) -> list[dict]:
    received = []
    headers = headers or {"Authorization": f"Bearer {KEY_A}"}
    with client.websocket_connect("/v1/tts/live", headers=headers) as socket:
        for event in events:
            socket.send_bytes(ormsgpack.packb(event))
        while True:
            message = ormsgpack.unpackb(socket.receive_bytes())
            received.append(message)
            if message["event"] == "finish":
                break
    return received


def test_live_session_streams_one_file(client, engine):
    start = {
        "event": "start",
        "request": {"text": "", "format": "wav", "reference_id": None, "prosody": None},
    }
    events = [
        start,
        {"event": "text", "text": "Hello "},
        {"event": "flush"},
        {"event": "text", "text": "world."},
    ]
    received = live_session(client, [*events, {"event": "stop"}])
    assert received[-1] == {"event": "finish", "reason": "stop"}
    data = b"".join(m["audio"] for m in received if m["event"] == "audio")
    assert data[:4] == b"RIFF" and data.count(b"RIFF") == 1
    assert [r.text for r in engine.submitted] == ["Hello ", "world."]
    assert all(r.priority.name == "REALTIME" for r in engine.submitted)
    assert engine.pages_used == 0


def test_live_short_session_in_a_buffering_format_still_gets_its_audio(client):
    """0.1 s of audio into mp3 at 16 kHz yields no bytes until the encoder is flushed: the
    session's audio must still arrive (before `finish`), as one decodable file."""
    start = {"event": "start", "request": {"text": "", "format": "mp3", "sample_rate": 16000}}
    received = live_session(client, [start, {"event": "text", "text": "a"}, {"event": "stop"}])
    assert received[-1] == {"event": "finish", "reason": "stop"}
    data = b"".join(m["audio"] for m in received if m["event"] == "audio")
    with av.open(io.BytesIO(data)) as container:
        samples = sum(frame.samples for frame in container.decode(audio=0))
    assert samples >= 1600  # the 0.1 s of tone at 16 kHz


def test_live_empty_session_and_errors(client):
    empty = live_session(client, [{"event": "start", "request": {"text": ""}}, {"event": "stop"}])
    assert empty == [{"event": "finish", "reason": "stop"}]
    bad_start = live_session(client, [{"event": "text", "text": "no start"}])
    assert bad_start[-1]["reason"] == "error"
    failing = live_session(
        client, [{"event": "start", "request": {}}, {"event": "text", "text": "FAIL"}, {"event": "stop"}]
    )
    assert failing[-1]["reason"] == "error"
    with pytest.raises(Exception):  # noqa: B017 (the denial surfaces as a transport-level error)
        live_session(client, [], headers={"Authorization": "Bearer wrong"})


def test_live_protocol_violations_end_with_a_clear_error(client, engine):
    start = {"event": "start", "request": {"text": "", "format": "pcm"}}
    twice = live_session(client, [start, start, {"event": "text", "text": "Hello."}, {"event": "stop"}])
    assert twice[-1]["reason"] == "error" and "start" in twice[-1]["message"]
    with client.websocket_connect("/v1/tts/live") as socket:
        socket.send_text("[" * 5000)  # JSON nested past the recursion limit
        finish = ormsgpack.unpackb(socket.receive_bytes())
    assert finish["reason"] == "error" and finish["message"].startswith("malformed message")
    with client.websocket_connect("/v1/tts/live") as socket:  # over max_body_bytes (2 MB here)
        socket.send_bytes(ormsgpack.packb({"event": "start", "request": {"text": "", "format": "pcm"}}))
        socket.send_bytes(ormsgpack.packb({"event": "text", "text": "y" * 2_000_001}))
        finish = ormsgpack.unpackb(socket.receive_bytes())
    assert finish["reason"] == "error" and "exceeds the 2000000-byte limit" in finish["message"]
    too_long = {"event": "start", "request": {"text": "x" * 501}}
    finish = live_session(client, [too_long, {"event": "stop"}])[-1]
    assert finish["reason"] == "error" and "exceeds" in finish["message"] and not engine.submitted
    assert engine.pages_used == 0


def test_live_client_gone_before_accept_releases_its_stream_slot(tmp_path, engine):
    """The handshake passed auth and took a stream slot, but the client vanished before the
    server's accept went out: the slot must come back, or the key ends up locked out (429)."""
    from uvicorn.protocols.utils import ClientDisconnected

    app = create_app(engine, Store.in_directory(tmp_path), ServerSettings(auth=False))
    scope = {
        "type": "websocket", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "ws",
        "path": "/v1/tts/live", "raw_path": b"/v1/tts/live", "query_string": b"", "root_path": "",
        "headers": [], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "subprotocols": [],
        "state": {},
    }  # fmt: skip

    async def receive() -> dict:
        return {"type": "websocket.connect"}

    async def send(message: dict) -> None:
        raise ClientDisconnected()  # what uvicorn raises once the peer has gone

    async def scenario() -> None:
        with anyio.fail_after(10):
            try:
                await app(scope, receive, send)
            except OSError:
                pass  # (before the fix it escaped; what matters is the slot)

    anyio.run(scenario)
    assert app.state.limiter.total == 0 and not engine.submitted


def test_live_prefills_voice_at_start(client, engine):
    reference = {"audio": wav_clip(), "text": "ref"}
    live_session(client, [{"event": "start", "request": {"references": [reference]}}, {"event": "stop"}])
    assert [[reference.text for reference in voice] for voice in engine.prefilled] == [["ref"]]


def test_split_ready_text():
    assert split_ready_text("short", 100) == ("", "short")
    text = "a" * 60 + ". " + "b" * 50
    assert split_ready_text(text, 100) == ("a" * 60 + ". ", "b" * 50)
    assert split_ready_text("c" * 150, 100) == ("", "c" * 150)
    head, rest = split_ready_text("word " * 50, 100)
    assert head and (head + rest) == "word " * 50
    # Never inside a number: "3.14" is no sentence end (so nothing is cut yet).
    assert split_ready_text("x" * 100 + " costs 3.14 dollars", 100) == ("", "x" * 100 + " costs 3.14 dollars")
    assert split_ready_text("y" * 100 + "。好", 100) == ("y" * 100 + "。", "好")


LONE_SURROGATE = '"bad \\ud800 text"'  # JSON for a string no UTF-8 encoder accepts


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/tts", '{"text": BAD}'),
        ("POST", "/v1/tts", '{"text": "ok", "reference_id": BAD}'),
        ("POST", "/v1/tts", '{"text": "ok", "references": [{"audio": "", "text": BAD}]}'),
        ("POST", "/v1/audio/speech", '{"input": BAD}'),
        ("POST", "/v1/jobs", '{"text": BAD}'),
        ("POST", "/v1/jobs", '{"items": [{"text": "ok"}, {"text": BAD}]}'),
        ("DELETE", "/v1/references/delete", '{"reference_id": BAD}'),
        ("POST", "/v1/references/update", '{"old_reference_id": "a", "new_reference_id": BAD}'),
    ],
)
def test_a_lone_surrogate_is_a_400_that_names_the_field(client, engine, method, path, body):
    content = body.replace("BAD", LONE_SURROGATE).encode()
    response = client.request(method, path, content=content, headers={"Content-Type": "application/json"})
    assert "Unicode" in assert_fish_error(response, 400)
    assert not engine.submitted
    assert client.get("/v1/jobs").json()["total"] == 0


def test_a_lone_surrogate_in_a_live_text_event_ends_the_session_with_an_error(client):
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with client.websocket_connect("/v1/tts/live", headers=headers) as socket:
        socket.send_bytes(ormsgpack.packb({"event": "start", "request": {"format": "pcm"}}))
        socket.send_text('{"event": "text", "text": BAD}'.replace("BAD", LONE_SURROGATE))
        finish = ormsgpack.unpackb(socket.receive_bytes())
    assert finish["event"] == "finish" and finish["reason"] == "error" and "Unicode" in finish["message"]


@pytest.fixture()
def quick_timeouts(tmp_path):
    """An app whose live sessions time out after a fraction of a second; its engine speaks each
    character for 0.1 s of audio in 0.05 s steps."""
    store = Store.in_directory(tmp_path)
    store.add_key(hash_api_key(KEY_A), tenant="a")
    settings = ServerSettings(live_start_timeout=0.3, live_idle_timeout=0.4)
    engine = ToneEngine(chunk_delay=0.05)
    with TestClient(create_app(engine, store, settings)) as test_client:
        yield test_client, engine


def finish_and_close(socket) -> tuple[list[dict], int]:
    """Every event up to `finish`, and the close code that follows it."""
    events = []
    while not events or events[-1]["event"] != "finish":
        events.append(ormsgpack.unpackb(socket.receive_bytes()))
    with pytest.raises(WebSocketDisconnect) as closed:
        socket.receive_bytes()
    return events, closed.value.code


@pytest.mark.parametrize("send_start", [False, True])
def test_a_silent_live_session_times_out_and_frees_its_slot(quick_timeouts, send_start):
    client, engine = quick_timeouts
    started = time.monotonic()
    with client.websocket_connect("/v1/tts/live", headers={"Authorization": f"Bearer {KEY_A}"}) as socket:
        assert client.app.state.limiter.total == 1
        if send_start:
            socket.send_bytes(ormsgpack.packb({"event": "start", "request": {"format": "pcm"}}))
        events, code = finish_and_close(socket)
    waited = time.monotonic() - started
    assert code == 1008 and events[-1]["reason"] == "error"
    expected = "no message for 0.4 s" if send_start else "no 'start' event for 0.3 s"
    assert expected in events[-1]["message"]
    assert waited >= (0.4 if send_start else 0.3) and waited < 5
    assert client.app.state.limiter.total == 0
    assert 'route="/v1/tts/live",status="408"' in client.get("/metrics").text


def test_waiting_for_audio_is_not_idle(quick_timeouts):
    """Twenty characters take a second to speak, more than twice the idle timeout: the session
    keeps streaming, then times out only once the audio is done and the client stays quiet."""
    client, engine = quick_timeouts
    with client.websocket_connect("/v1/tts/live", headers={"Authorization": f"Bearer {KEY_A}"}) as socket:
        socket.send_bytes(ormsgpack.packb({"event": "start", "request": {"format": "pcm"}}))
        socket.send_bytes(ormsgpack.packb({"event": "text", "text": "twenty characters!!!"}))
        socket.send_bytes(ormsgpack.packb({"event": "flush"}))
        spoken_at = time.monotonic()
        events, code = finish_and_close(socket)
    audio = b"".join(event["audio"] for event in events if event["event"] == "audio")
    assert len(audio) == 2 * 20 * (engine.sample_rate // 10)  # every chunk arrived
    assert code == 1008 and time.monotonic() - spoken_at >= 1.0 + 0.4


def test_live_overload_is_a_refusal_not_an_internal_error(client, engine, caplog):
    engine.max_waiting = 0
    events = live_session(
        client,
        [
            {"event": "start", "request": {"format": "pcm"}},
            {"event": "text", "text": "Hi."},
            {"event": "stop"},
        ],
    )
    assert events[-1]["reason"] == "error" and "capacity" in events[-1]["message"]
    metrics = client.get("/metrics").text
    assert 'route="/v1/tts/live",status="503"' in metrics and 'status="500"' not in metrics
    assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info]


def test_a_voice_the_model_cannot_speak_with_is_refused_at_upload(client, engine):
    engine.max_voice_frames = 30  # wav_clip(): one second, 21 frames; two seconds do not fit
    files = [("voices", ("long.wav", wav_clip(2.0), "audio/wav"))]
    assert "exceeds the context" in assert_fish_error(
        client.post("/model", data={"title": "t"}, files=files), 400
    )
    files = {"audio": ("long.wav", wav_clip(2.0), "audio/wav")}
    refused = client.post("/v1/references/add", data={"id": "long"}, files=files)
    assert "exceeds the context" in assert_fish_error(refused, 400)
    assert client.get("/model").json()["total"] == 0
    assert client.get("/v1/references/list?format=json").json()["reference_ids"] == []
    files = [("voices", ("short.wav", wav_clip(1.0), "audio/wav"))]
    assert client.post("/model", data={"title": "t"}, files=files).status_code == 201


def test_the_server_sweeps_orphan_blobs_when_it_starts(tmp_path):
    import os

    store = Store.in_directory(tmp_path)
    orphan = tmp_path / "blobs" / "voices" / "gone" / "sample.audio.tmp"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"left by a crash")
    an_hour_ago = time.time() - 3600
    os.utime(orphan, (an_hour_ago, an_hour_ago))
    with TestClient(create_app(ToneEngine(), store, ServerSettings(auth=False))) as client:
        assert client.get("/v1/health").status_code == 200
        assert not orphan.exists() and not orphan.parent.exists()


@pytest.mark.parametrize("path", ["/v1/jobs", "/model"])
def test_a_huge_page_number_is_a_422_not_an_overflow(client, path):
    for page in ("9223372036854775807", "286883999691015083155283937067008"):
        message = assert_fish_error(client.get(path, params={"page_number": page}), 422)
        assert "page_number" in message
    last = client.get(path, params={"page_number": 1_000_000})
    assert last.status_code == 200 and last.json()["items"] == []
