"""The web pages in a real browser (headless Chromium, tests/browser_testing.py) against a real
`shoal serve` on the demo checkpoint with keys on: speak and hear it while it is generated,
create a voice from an upload and speak with it, watch the dashboard move during a request,
manage voices, and read a bad key's error. One server and one browser for the module; each
test gets a fresh browser context (an empty sessionStorage, so no key). Screenshots are saved
as test artifacts."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import ormsgpack
import pytest
from browser_testing import PageErrors, artifacts_dir, chromium
from prometheus_client.parser import text_string_to_metric_families
from server_process import ShoalServer, app_in_thread, create_voice, wav_clip

pytestmark = pytest.mark.slow
SPOKEN_FRAMES = 24  # what the page asks for (Max frames): about a second of audio
LONG_FRAMES = 150  # the dashboard's request: long enough to be seen running (a few seconds)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ShoalServer:
    workdir = tmp_path_factory.mktemp("shoal-web")
    with ShoalServer.start(workdir, "--max-new-frames", str(LONG_FRAMES)) as running:
        yield running


@pytest.fixture(scope="module")
def browser():
    with chromium() as running:
        yield running


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    errors = PageErrors(page)
    yield page
    context.close()
    errors.assert_none()


def screenshot(page, name: str) -> None:
    page.screenshot(path=str(artifacts_dir() / f"{name}.png"), full_page=True)


def metric(server: ShoalServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


def use_key(page, key: str) -> None:
    page.fill("#api-key", key)
    page.click("#use-key")
    page.wait_for_selector(f"#key-state:has-text('…{key[-4:]}')")


def stat(page, cell: str) -> float:
    return float(page.get_attribute(f"#{cell}", "data-value"))


def speak(page, format: str = "pcm") -> None:
    page.fill("#max-new-tokens", str(SPOKEN_FRAMES))
    page.select_option("#format", format)
    page.click("#speak")
    page.wait_for_selector("#run-state[data-state=played], #run-state[data-state=failed]")
    assert page.get_attribute("#run-state", "data-state") == "played", page.inner_text("#message")


def test_the_playground_plays_audio_while_it_is_generated(server, page):
    requested_urls = []
    page.on("request", lambda request: requested_urls.append(request.url))
    page.on("websocket", lambda socket: requested_urls.append(socket.url))
    page.goto(server.url)
    use_key(page, server.key_a)
    delivered_before = metric(server, "shoal_audio_seconds_total")
    page.fill("#text", "Hello from the browser test. It speaks as it generates.")
    page.fill("#seed", "7")
    speak(page, "pcm")

    seconds, first_audio, factor = (
        stat(page, "audio-length"),
        stat(page, "first-audio"),
        stat(page, "real-time-factor"),
    )
    # The length the page reports is what the server generated: its frames, as audio seconds.
    delivered = metric(server, "shoal_audio_seconds_total") - delivered_before
    assert seconds == pytest.approx(delivered, abs=1e-3)
    assert 0 < seconds <= SPOKEN_FRAMES * 2048 / 44100 + 1e-6  # at most the frames asked for
    # Playback started before the generation ended (first audio before the last), and the
    # browser played every sample: from the first to the last, the audio plus any gaps.
    wall = factor * seconds
    assert 0 < first_audio < wall
    played = float(page.get_attribute("#run-state", "data-played-seconds"))
    gaps = float(page.get_attribute("#run-state", "data-gap-seconds"))
    assert seconds + gaps - 0.02 < played < seconds + gaps + 0.3
    assert page.get_attribute("#download", "download") == "shoal.wav"
    assert page.evaluate("document.getElementById('replay').duration") == pytest.approx(seconds, abs=0.01)
    # The key travelled in headers and the socket's subprotocol, never in a URL.
    assert requested_urls and not any(server.key_a in url for url in requested_urls)
    screenshot(page, "playground")


def test_a_voice_created_from_an_upload_speaks(server, page):
    page.goto(server.url)
    use_key(page, server.key_a)
    page.fill("#voice-title", "uploaded tone")
    page.set_input_files("#voice-file", {"name": "tone.wav", "mimeType": "audio/wav", "buffer": wav_clip()})
    page.fill("#voice-text", "a steady tone")
    page.click("#create-voice")
    page.wait_for_selector(".message.info:has-text('Created the voice')")
    voice_id = page.eval_on_selector("#voice", "select => select.value")
    headers = {"Authorization": f"Bearer {server.key_a}"}
    voice = httpx.get(f"{server.url}/model/{voice_id}", headers=headers).json()
    assert voice["title"] == "uploaded tone" and voice["samples"][0]["text"] == "a steady tone"

    speak(page, "wav")
    assert stat(page, "audio-length") > 0
    deadline = time.monotonic() + 5  # use counts are written in batches, within a second
    while httpx.get(f"{server.url}/model/{voice_id}", headers=headers).json()["task_count"] < 1:
        assert time.monotonic() < deadline, "the live session spoke with the new voice"
        time.sleep(0.1)
    screenshot(page, "playground-new-voice")


def card_value(page, group: str, card: str) -> float | None:
    value = page.get_attribute(f"{group} [data-metric={card}] .value", "data-value")
    return None if value is None else float(value)


# Every card's number in a group, read at once: all from the same scrape.
CARD_VALUES = """(group) => Object.fromEntries([...document.querySelectorAll(`${group} [data-metric]`)].map(
  (card) => [card.dataset.metric, card.querySelector(".value").dataset.value ?? null]))"""


def wait_for_cards(page, group: str, ready, timeout: float = 60) -> dict:
    """The first reading of the group's cards for which `ready(values)` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        values = {
            name: None if value is None else float(value)
            for name, value in page.evaluate(CARD_VALUES, group).items()
        }
        if ready(values):
            return values
        page.wait_for_timeout(50)
    raise AssertionError(f"the dashboard never showed it: {values}")


def test_the_dashboard_moves_while_a_request_runs(server, page):
    server_group = "#groups > section:first-child"
    page.goto(f"{server.url}/dashboard?interval=200")
    idle = wait_for_cards(page, server_group, lambda values: values["running"] == 0)
    body = {"text": "A longer request for the dashboard to watch.", "format": "pcm"}
    body["max_new_tokens"] = LONG_FRAMES
    headers = {"Authorization": f"Bearer {server.key_a}"}
    responses = []
    request = threading.Thread(
        target=lambda: responses.append(
            httpx.post(f"{server.url}/v1/tts", json=body, headers=headers, timeout=120)
        )
    )
    request.start()
    try:
        busy = wait_for_cards(page, server_group, lambda values: values["running"] == 1 and values["frames"])
        assert busy["kv-pages"] > idle["kv-pages"] and busy["streams"] == 1
        screenshot(page, "dashboard")
    finally:
        request.join()
    assert responses[0].status_code == 200, responses[0].text
    done = wait_for_cards(page, server_group, lambda values: values["running"] == 0 and values["first-audio"])
    assert 0 < done["first-audio"] < 30 and done["kv-pages"] < busy["kv-pages"]


ENGINES_METRICS = """\
# TYPE shoal_engine_up gauge
shoal_engine_up 1.0
shoal_running_batch_size 5.0
shoal_queue_depth{priority="realtime"} 1.0
shoal_queue_depth{priority="standard"} 2.0
shoal_engine_running_batch_size{engine="0"} 2.0
shoal_engine_running_batch_size{engine="1"} 3.0
shoal_engine_queue_depth{engine="0",priority="standard"} 2.0
shoal_engine_queue_depth{engine="1",priority="realtime"} 1.0
shoal_engine_process_up{engine="0"} 1.0
shoal_engine_process_up{engine="1"} 0.0
shoal_time_to_first_audio_seconds_bucket{le="0.1",route="live"} 0.0
shoal_time_to_first_audio_seconds_bucket{le="0.15",route="live"} 6.0
shoal_time_to_first_audio_seconds_bucket{le="+Inf",route="live"} 6.0
shoal_time_to_first_audio_seconds_bucket{le="0.1",route="/v1/tts"} 0.0
shoal_time_to_first_audio_seconds_bucket{le="0.15",route="/v1/tts"} 4.0
shoal_time_to_first_audio_seconds_bucket{le="+Inf",route="/v1/tts"} 4.0
"""


def test_the_dashboard_shows_each_engine_of_several(server, page):
    """Several engines label their series `engine`: one group each, beside the server's totals;
    first-audio percentiles come from the histogram's buckets summed over routes."""
    page.route("**/metrics", lambda route: route.fulfill(body=ENGINES_METRICS, content_type="text/plain"))
    page.goto(f"{server.url}/dashboard?interval=200")
    page.wait_for_selector("[data-engine='1'] [data-metric=running] .value[data-value]")
    assert card_value(page, "#groups > section:first-child", "running") == 5
    assert card_value(page, "[data-engine='0']", "running") == 2
    assert card_value(page, "[data-engine='1']", "queue") == 1
    assert "down" in page.inner_text("[data-engine='1'] h2")
    # Ten observations in (0.1, 0.15]: the median is halfway through the bucket.
    assert card_value(page, "#groups > section:first-child", "first-audio") == pytest.approx(0.125)


def test_the_voices_page_manages_a_voice(server, page):
    voice_id = create_voice(server, title="managed", text="the managed reference")
    page.goto(server.url)
    use_key(page, server.key_a)
    page.click("nav >> text=Voices")  # the key stays for the tab's session, across pages
    row = page.locator(f"tr[data-voice-id='{voice_id}']")
    row.locator("button.play").click()
    page.wait_for_selector("#reference-state[data-state=played]")
    row.locator("input.title").fill("renamed")
    row.locator("button.rename").click()
    page.wait_for_selector(".message.info:has-text('Renamed')")
    row.locator("select").select_option("public")
    page.wait_for_selector(".message.info:has-text('is now public')")
    headers = {"Authorization": f"Bearer {server.key_a}"}
    voice = httpx.get(f"{server.url}/model/{voice_id}", headers=headers).json()
    assert (voice["title"], voice["visibility"]) == ("renamed", "public")
    screenshot(page, "voices")
    # Another tenant sees the public voice but cannot change it.
    page.fill("#api-key", server.key_b)
    page.click("#use-key")
    page.wait_for_selector(f"tr[data-voice-id='{voice_id}'] button.delete[disabled]")
    use_key(page, server.key_a)
    page.wait_for_selector(f"tr[data-voice-id='{voice_id}'] button.delete:not([disabled])")
    page.once("dialog", lambda dialog: dialog.accept())
    row.locator("button.delete").click()
    page.wait_for_selector(".message.info:has-text('Deleted')")
    assert httpx.get(f"{server.url}/model/{voice_id}", headers=headers).status_code == 404


def test_a_bad_key_shows_a_readable_error(server, page):
    page.goto(server.url)
    page.wait_for_selector(".message.error:has-text('Error 401: missing API key')")  # the voice list
    use_key(page, "shoal_not_a_key")
    page.click("#speak")
    page.wait_for_selector("#run-state[data-state=failed]")
    assert page.inner_text("#message").startswith("Error 401: Invalid Token")
    screenshot(page, "bad-key")
    page.goto(f"{server.url}/voices")
    page.wait_for_selector(".message.error:has-text('Error 401: Invalid Token')")


def test_the_pages_work_without_auth(browser, tmp_path):
    """`--no-auth`: no key is asked for; the playground speaks, and stops when asked (a tone
    engine, in-process)."""
    from server_fakes import ToneEngine

    from shoal.server.app import create_app
    from shoal.server.settings import ServerSettings
    from shoal.server.store import Store

    app = create_app(ToneEngine(), Store.in_directory(tmp_path), ServerSettings(auth=False))
    context = browser.new_context()
    page = context.new_page()
    errors = PageErrors(page)
    with app_in_thread(app) as url:
        page.goto(f"{url}/voices")
        page.wait_for_selector("#empty:not([hidden])")
        page.goto(url)
        page.fill("#text", "A text long enough to be stopped while it plays.")
        page.click("#speak")
        page.wait_for_selector("#run-state[data-state=playing]")
        page.click("#stop")
        page.wait_for_selector("#run-state[data-state=stopped]")
        page.fill("#text", "Hi there")
        page.click("#speak")
        page.wait_for_selector("#run-state[data-state=played]")
        assert stat(page, "audio-length") == pytest.approx(0.8, abs=0.01)  # 0.1 s per character
        assert page.is_hidden("#message")
    context.close()
    errors.assert_none()


MSGPACK_SAMPLES = [
    {"event": "start", "request": {"text": "", "format": "pcm", "temperature": 0.7, "seed": None}},
    {"event": "text", "text": "héllo ✓ " * 40},  # str16
    [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**53 - 1],
    [-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**53) + 1],
    [0.5, -2.25, 1e300, True, False, None, "", "x" * 31, "x" * 32, "x" * 255, "x" * 256, "y" * 70000],
    {str(index): index for index in range(20)},  # map16
    list(range(20)),  # array16
]


# Runs in the page: encodes or decodes each item with the pages' own module (bytes in base64).
MSGPACK_IN_PAGE = """async ([operation, items]) => {
  const msgpack = await import("/web/msgpack.js");
  const toBase64 = (bytes) => btoa(Array.from(bytes, (byte) => String.fromCharCode(byte)).join(""));
  const fromBase64 = (text) => Uint8Array.from(atob(text), (character) => character.charCodeAt(0));
  if (operation === "encode") return items.map((item) => toBase64(msgpack.encode(item)));
  return items.map((text) => {
    const value = msgpack.decode(fromBase64(text));
    return value?.audio instanceof Uint8Array ? { ...value, audio: toBase64(value.audio) } : value;
  });
}"""


def in_page(page, operation: str, items: list) -> list:
    return page.evaluate(MSGPACK_IN_PAGE, [operation, items])


def test_the_pages_msgpack_agrees_with_the_servers(server, page):
    """The pages' own MessagePack codec (web/msgpack.js) and ormsgpack read each other's bytes."""
    page.goto(server.url)
    encoded = in_page(page, "encode", MSGPACK_SAMPLES)
    assert [ormsgpack.unpackb(base64.b64decode(item)) for item in encoded] == MSGPACK_SAMPLES
    payloads = [base64.b64encode(ormsgpack.packb(value)).decode() for value in MSGPACK_SAMPLES]
    assert in_page(page, "decode", payloads) == MSGPACK_SAMPLES
    audio = bytes(range(256)) * 300
    events = [{"event": "audio", "audio": audio[:size]} for size in (10, 300, 70000)]  # bin 8, 16, 32
    decoded = in_page(page, "decode", [base64.b64encode(ormsgpack.packb(e)).decode() for e in events])
    assert [base64.b64decode(event["audio"]) for event in decoded] == [
        audio[:size] for size in (10, 300, 70000)
    ]
