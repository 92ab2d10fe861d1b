"""LiveKit Agents' Fish Audio plugin (`livekit-plugins-fishaudio` 1.8.9), unchanged, against a real
`shoal serve` on the demo checkpoint, outside a LiveKit room: pointed at Shoal only by its
`base_url` option, it synthesizes one-shot (`POST /v1/tts`) and streamed (`/v1/tts/live`), turn
after turn on one TTS object, whose connection pool reuses one WebSocket for every turn.

The plugin takes an aiohttp session as an argument (inside an agent job it borrows the job's), so
no LiveKit server or room is needed."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import pytest
from livekit.agents import APIConnectOptions, APIStatusError, tts
from livekit.plugins import fishaudio
from server_process import ShoalServer, create_voice

pytestmark = pytest.mark.slow
NO_RETRY = APIConnectOptions(max_retry=0, timeout=30)
TURNS = ("First turn. It has two sentences.", "Second turn here.", "And a third one!")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ShoalServer:
    with ShoalServer.start(tmp_path_factory.mktemp("shoal-livekit")) as running:
        yield running


@pytest.fixture(scope="module")
def voice_id(server) -> str:
    """A voice stored on the server: what the plugin's `voice_id` names with Shoal."""
    return create_voice(server)


def check_frames(events: list[tts.SynthesizedAudio], sample_rate: int) -> float:
    """The events' total audio seconds, after checking each frame is mono at `sample_rate`."""
    assert events, "no audio frames"
    for event in events:
        assert event.frame.sample_rate == sample_rate and event.frame.num_channels == 1
    seconds = sum(event.frame.samples_per_channel for event in events) / sample_rate
    assert seconds > 0.1, seconds
    return seconds


async def one_shot(plugin: fishaudio.TTS, text: str) -> list[tts.SynthesizedAudio]:
    async with plugin.synthesize(text, conn_options=NO_RETRY) as stream:
        return [event async for event in stream]


async def streamed_turn(plugin: fishaudio.TTS, text: str) -> list[tts.SynthesizedAudio]:
    """One agent turn as LiveKit drives it: text pushed as the LLM writes it, then the end."""
    async with plugin.stream(conn_options=NO_RETRY) as stream:
        for word in text.split(" "):
            stream.push_text(word + " ")
        stream.flush()
        stream.end_input()
        return [event async for event in stream]


@pytest.mark.parametrize("output_format", ["wav", "pcm", "mp3"])
def test_one_shot_and_streamed_turns_reuse_one_socket(server, voice_id, output_format):
    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            plugin = fishaudio.TTS(
                api_key=server.key_a,
                base_url=server.url,
                voice_id=voice_id,
                output_format=output_format,
                http_session=http,
            )
            errors: list[tts.TTSError] = []
            plugin.on("error", errors.append)
            try:
                check_frames(await one_shot(plugin, "Hello from Shoal."), plugin.sample_rate)
                for turn, text in enumerate(TURNS):
                    events = await asyncio.wait_for(streamed_turn(plugin, text), timeout=120)
                    check_frames(events, plugin.sample_rate)
                    # The pool handed the same WebSocket out again: Shoal kept it open after the
                    # turn's `finish` and took the next `start` on it.
                    assert plugin._pool.last_connection_reused == (turn > 0)
                assert len(plugin._pool._connections) == 1
            finally:
                await plugin.aclose()
            # Not even a recovered failure (a retry on a fresh socket) on the way.
            assert errors == []

    asyncio.run(scenario())


def test_an_empty_voice_id_is_the_models_default_voice(server):
    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            plugin = fishaudio.TTS(api_key=server.key_a, base_url=server.url, voice_id="", http_session=http)
            try:
                check_frames(await one_shot(plugin, "Default voice."), plugin.sample_rate)
                check_frames(await streamed_turn(plugin, "Default voice, streamed."), plugin.sample_rate)
            finally:
                await plugin.aclose()

    asyncio.run(scenario())


def test_the_cloud_default_voice_is_an_error_that_names_it(server):
    """Left at its default, the plugin asks for a Fish cloud voice id, which no Shoal server has:
    one-shot gets a 404, streamed a `finish`/`error` event that names the id and says what to do."""
    cloud_voice = fishaudio.tts.DEFAULT_VOICE_ID

    async def scenario() -> tuple[APIStatusError, APIStatusError]:
        async with aiohttp.ClientSession() as http:
            plugin = fishaudio.TTS(api_key=server.key_a, base_url=server.url, http_session=http)
            try:
                with pytest.raises(APIStatusError) as one_shot_error:
                    await one_shot(plugin, "Hello.")
                with pytest.raises(APIStatusError) as streamed_error:
                    await streamed_turn(plugin, "Hello.")
            finally:
                await plugin.aclose()
            return one_shot_error.value, streamed_error.value

    one_shot_error, streamed_error = asyncio.run(scenario())
    assert one_shot_error.status_code == 404
    assert cloud_voice in str(streamed_error.body) and "POST /model" in str(streamed_error.body)
    headers = {"Authorization": f"Bearer {server.key_a}"}
    body = {"text": "x", "reference_id": cloud_voice}
    response = httpx.post(f"{server.url}/v1/tts", json=body, headers=headers)
    assert response.status_code == 404 and cloud_voice in response.json()["message"]
