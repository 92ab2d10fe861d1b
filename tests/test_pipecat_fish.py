"""Pipecat's Fish Audio TTS service (`pipecat-ai[fish]` 1.14.0, `FishAudioTTSService`), unchanged,
against a real `shoal serve` on the demo checkpoint, in a minimal real Pipecat pipeline
(source -> service -> sink, Pipecat's own `QueuedFrameProcessor` test taps) with no transport.

The service has no base-URL option: `__init__` sets `self._base_url =
"wss://api.fish.audio/v1/tts/live"`, so it is pointed at Shoal by assigning that attribute after
construction, the only change. It opens one live WebSocket at pipeline start (a `model: s2.1-pro`
header, which Shoal ignores) and sends `start` at once, then `text` + `flush` per utterance and
`stop` only when it disconnects, so every turn is an utterance of one Shoal session. A turn ends,
for Pipecat, when no audio came for `stop_frame_timeout_s`. An interruption closes the socket
(`stop`, then close; no `cancel`) and opens a fresh one with a new `start`."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.fish.tts import FishAudioTTSService
from pipecat.tests.utils import QueuedFrameProcessor
from pipecat.workers.runner import WorkerRunner
from server_process import ShoalServer, create_voice

pytestmark = pytest.mark.slow
SAMPLE_RATE = 16000  # the pipeline's output rate: Pipecat asks Fish (here Shoal) for it in `start`
# Pipecat ends a turn once no audio came for this long (its default is 3 s); a margin for a busy CPU.
TURN_GAP_S = 4.0
TURN_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ShoalServer:
    with ShoalServer.start(tmp_path_factory.mktemp("shoal-pipecat")) as running:
        yield running


@pytest.fixture(scope="module")
def voice_id(server) -> str:
    """A voice stored on the server: what the service's `Settings(voice=...)` names with Shoal."""
    return create_voice(server)


def fish_service(server: ShoalServer, voice: str | None) -> FishAudioTTSService:
    service = FishAudioTTSService(
        api_key=server.key_a,
        settings=FishAudioTTSService.Settings(voice=voice),
        stop_frame_timeout_s=TURN_GAP_S,
    )
    # No constructor option for the URL (pipecat/services/fish/tts.py hard-codes the cloud's).
    service._base_url = server.url.replace("http://", "ws://", 1) + "/v1/tts/live"
    return service


class Bot:
    """A running pipeline around the service: `speak` queues a TTSSpeakFrame and returns the turn's
    frames, up to its TTSStoppedFrame; `errors` are the ErrorFrames that went upstream."""

    def __init__(self, service: FishAudioTTSService):
        self.service = service
        self.down: asyncio.Queue[Frame] = asyncio.Queue()
        self.up: asyncio.Queue[Frame] = asyncio.Queue()
        self.upstream: list[Frame] = []
        source = QueuedFrameProcessor(queue=self.up, queue_direction=FrameDirection.UPSTREAM)
        sink = QueuedFrameProcessor(queue=self.down, queue_direction=FrameDirection.DOWNSTREAM)
        params = PipelineParams(audio_out_sample_rate=SAMPLE_RATE)
        self.worker = PipelineWorker(
            Pipeline([source, service, sink]), params=params, cancel_on_idle_timeout=False
        )
        self.started = asyncio.Event()
        self.worker.event_handler("on_pipeline_started")(self.on_started)
        self.runner = WorkerRunner(handle_sigint=False)
        self.task: asyncio.Task | None = None

    async def on_started(self, worker, frame) -> None:
        self.started.set()

    async def __aenter__(self) -> Bot:
        await self.runner.add_workers(self.worker)
        self.task = asyncio.create_task(self.runner.run())
        await asyncio.wait_for(self.started.wait(), timeout=30)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.worker.queue_frame(EndFrame())
        await asyncio.wait_for(self.task, timeout=60)

    async def next_frame(self) -> Frame:
        return await asyncio.wait_for(self.down.get(), timeout=TURN_TIMEOUT_S)

    async def speak(self, text: str) -> list[Frame]:
        await self.worker.queue_frame(TTSSpeakFrame(text))
        frames = []
        while not isinstance(frame := await self.next_frame(), TTSStoppedFrame):
            frames.append(frame)
        return frames

    def errors(self) -> list[Frame]:
        while not self.up.empty():
            self.upstream.append(self.up.get_nowait())
        return [frame for frame in self.upstream if isinstance(frame, ErrorFrame)]


def audio_seconds(frames: list[Frame]) -> float:
    """A turn's audio seconds, after checking each chunk is 16-bit mono PCM at the pipeline's rate
    and belongs to the turn's context (none left over from an earlier turn)."""
    started = [frame for frame in frames if isinstance(frame, TTSStartedFrame)]
    chunks = [frame for frame in frames if isinstance(frame, TTSAudioRawFrame)]
    assert len(started) == 1 and chunks, [type(frame).__name__ for frame in frames]
    for chunk in chunks:
        assert chunk.sample_rate == SAMPLE_RATE and chunk.num_channels == 1
        assert chunk.context_id == started[0].context_id
        assert len(chunk.audio) > 0
    pcm = b"".join(chunk.audio for chunk in chunks)
    assert len(pcm) % 2 == 0
    seconds = len(pcm) / 2 / SAMPLE_RATE
    assert seconds > 0.1, seconds
    assert np.abs(np.frombuffer(pcm, dtype="<i2")).max() > 0  # not silence
    return seconds


def test_turns_on_one_socket_then_an_interruption_reconnects(server, voice_id):
    async def scenario() -> None:
        async with Bot(fish_service(server, voice_id)) as bot:
            socket = bot.service._websocket
            assert socket is not None, bot.errors()
            for text in ("First turn. It has two sentences.", "Second turn here."):
                frames = await bot.speak(text)
                audio_seconds(frames)
                # Every turn was an utterance (`text` + `flush`) of the session opened at start.
                assert bot.service._websocket is socket

            # Barge-in: interrupted at its first audio, the service closes its socket and opens
            # another with a new `start`, and the next turn is spoken on that one.
            await bot.worker.queue_frame(
                TTSSpeakFrame("This turn is cut off. It goes on and on for a while.")
            )
            while not isinstance(await bot.next_frame(), TTSAudioRawFrame):
                pass
            await bot.worker.queue_frame(InterruptionFrame())
            deadline = time.monotonic() + 30
            while bot.service._websocket in (socket, None):
                assert time.monotonic() < deadline, "no reconnect after the interruption"
                await asyncio.sleep(0.05)
            while not bot.down.empty():  # what the interrupted turn had already pushed
                bot.down.get_nowait()
            audio_seconds(await bot.speak("After the interruption."))
            assert bot.errors() == []

    asyncio.run(scenario())


def test_no_voice_is_the_models_default_voice(server):
    """`Settings(voice=None)` (the service's default) sends `reference_id: None`: the model's
    default voice on Shoal, no Fish cloud id involved."""

    async def scenario() -> None:
        async with Bot(fish_service(server, None)) as bot:
            audio_seconds(await bot.speak("Default voice."))
            assert bot.errors() == []

    asyncio.run(scenario())
