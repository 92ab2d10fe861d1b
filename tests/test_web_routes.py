"""The web pages' server side, in-process over the ToneEngine test double: the pages and assets
(media types, security headers, shipped in the package), the live socket's browser
authentication (the key in a subprotocol, refusals told in-band) and a voice's reference clip.
The pages themselves run in a real browser in tests/test_web_playground.py."""

from __future__ import annotations

import base64
import fnmatch
import re
import tomllib
from pathlib import Path

import ormsgpack
import pytest
from fastapi.testclient import TestClient
from server_fakes import ToneEngine
from server_process import wav_clip
from starlette.websockets import WebSocketDisconnect

from shoal.server.app import create_app
from shoal.server.auth import hash_api_key
from shoal.server.settings import ServerSettings
from shoal.server.store import Store
from shoal.server.web import WEB_DIR

REPO = Path(__file__).resolve().parents[1]
KEY_A = "shoal_web_key_tenant_a"
KEY_B = "shoal_web_key_tenant_b"  # one stream at a time


@pytest.fixture()
def client(tmp_path):
    store = Store.in_directory(tmp_path)
    store.add_key(hash_api_key(KEY_A), tenant="a")
    store.add_key(hash_api_key(KEY_B), tenant="b", max_streams=1)
    with TestClient(create_app(ToneEngine(), store, ServerSettings())) as test_client:
        yield test_client


def key_protocol(key: str) -> str:
    return "shoal.key." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def test_pages_and_assets_are_served_with_their_types_and_policy(client):
    for path in ("/", "/dashboard", "/voices"):
        response = client.get(path)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in response.headers["content-security-policy"]
        assert client.head(path).status_code == 200 and "/web/style.css" in response.text
    script = client.get("/web/playground.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert script.headers["x-content-type-options"] == "nosniff"
    for missing in ("/web/nothing.js", "/web/%2E%2E%2Fweb.py", "/web/..%2Fapp.py", "/web/README"):
        response = client.get(missing)
        assert response.status_code == 404 and set(response.json()) == {"status", "message"}, missing
    paths = client.get("/openapi.json").json()["paths"]
    assert not {"/", "/dashboard", "/voices", "/web/{name}"} & set(paths), "the pages are not API"


def test_every_page_file_ships_in_the_wheel():
    """pyproject's package-data globs take every file of shoal/server/web (a module, style sheet
    or page left out would be missing from a non-editable install)."""
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "shoal"
    ]
    files = [path.relative_to(REPO / "shoal").as_posix() for path in WEB_DIR.iterdir() if path.is_file()]
    assert len(files) >= 10
    for name in files:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in globs), name


def test_each_page_loads_only_assets_that_exist():
    """Every /web/ reference in the pages and every relative import in the modules resolves."""
    for page in ("playground.html", "dashboard.html", "voices.html"):
        for asset in re.findall(r'"/web/([^"]+)"', (WEB_DIR / page).read_text()):
            assert (WEB_DIR / asset).is_file(), (page, asset)
    for module in WEB_DIR.glob("*.js"):
        for imported in re.findall(r'from "\./([^"]+)"', module.read_text()):
            assert (WEB_DIR / imported).is_file(), (module.name, imported)


def speak_pcm(socket) -> list[dict]:
    for event in (
        {"event": "start", "request": {"format": "pcm"}},
        {"event": "text", "text": "Hi"},
        {"event": "stop"},
    ):
        socket.send_bytes(ormsgpack.packb(event))
    events = []
    while not events or events[-1]["event"] != "finish":
        events.append(ormsgpack.unpackb(socket.receive_bytes()))
    return events


def test_a_browser_authenticates_the_live_socket_with_a_subprotocol(client):
    with client.websocket_connect("/v1/tts/live", subprotocols=["shoal.live", key_protocol(KEY_A)]) as socket:
        assert socket.accepted_subprotocol == "shoal.live", "the key is never echoed back"
        events = speak_pcm(socket)
    assert events[-1] == {"event": "finish", "reason": "stop"}
    assert any(event["event"] == "audio" and event["audio"] for event in events)

    # The header works with the browser subprotocol too, and the official clients are unchanged.
    def header() -> dict:  # (the test client adds its handshake headers to the dict it is given)
        return {"Authorization": f"Bearer {KEY_A}"}

    with client.websocket_connect("/v1/tts/live", headers=header(), subprotocols=["shoal.live"]) as socket:
        assert speak_pcm(socket)[-1]["reason"] == "stop"
    with client.websocket_connect("/v1/tts/live", headers=header()) as socket:
        assert socket.accepted_subprotocol is None
        assert speak_pcm(socket)[-1]["reason"] == "stop"


def refusal(client, subprotocols: list[str]) -> tuple[dict, int]:
    with client.websocket_connect("/v1/tts/live", subprotocols=subprotocols) as socket:
        event = ormsgpack.unpackb(socket.receive_bytes())
        with pytest.raises(WebSocketDisconnect) as closed:
            socket.receive_bytes()
    return event, closed.value.code


@pytest.mark.parametrize(
    ("offered", "message"),
    [
        ([key_protocol("shoal_wrong")], "Invalid Token"),
        (["shoal.key.%%%"], "Invalid Token"),  # not base64url: a wrong key, not a crash
        ([], "missing API key"),
    ],
)
def test_a_browser_is_told_why_its_socket_was_refused(client, offered, message):
    event, code = refusal(client, ["shoal.live", *offered])
    assert event["event"] == "finish" and event["reason"] == "error" and event["status"] == 401
    assert message in event["message"] and code == 1008
    assert 'route="/v1/tts/live",status="401"' in client.get("/metrics").text


def test_an_official_client_still_gets_the_http_refusal(client):
    with pytest.raises(Exception):  # noqa: B017 (the denial surfaces as a transport-level error)
        with client.websocket_connect("/v1/tts/live", headers={"Authorization": "Bearer shoal_wrong"}):
            pass


def test_a_browser_over_its_stream_limit_is_told_to_retry(client):
    offered = ["shoal.live", key_protocol(KEY_B)]
    with client.websocket_connect("/v1/tts/live", subprotocols=offered):
        event, code = refusal(client, offered)
    assert event["status"] == 429 and code == 1013 and "stream" in event["message"]


def test_a_voice_reference_clip_plays_back_as_uploaded(client):
    clip = wav_clip()
    headers = {"Authorization": f"Bearer {KEY_A}"}
    files = [("voices", ("clip.wav", clip, "audio/wav"))]
    created = client.post("/model", data={"title": "tone", "texts": "a tone"}, files=files, headers=headers)
    voice_id = created.json()["_id"]
    response = client.get(f"/model/{voice_id}/samples/0/audio", headers=headers)
    assert response.status_code == 200 and response.content == clip
    assert response.headers["content-type"] == "audio/wav"
    assert client.get(f"/model/{voice_id}/samples/1/audio", headers=headers).status_code == 404
    other = {"Authorization": f"Bearer {KEY_B}"}
    assert client.get(f"/model/{voice_id}/samples/0/audio", headers=other).status_code == 404  # private
    assert client.get(f"/model/{voice_id}/samples/0/audio").status_code == 401
