"""The API server's limits and switches (the engine's own settings live in `shoal.config`):
one dataclass every route module reads through `app.state.settings`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerSettings:
    """Limits and switches of the API server (the engine's own settings live in shoal.config)."""

    auth: bool = True
    max_text_length: int = 10_000  # characters per request or live session
    max_body_bytes: int = 64 * 1024 * 1024  # whole request / WebSocket message
    max_upload_bytes: int = 20 * 1024 * 1024  # one audio file
    max_upload_seconds: float = 120.0  # one audio file's duration
    max_voice_samples: int = 20  # audio files per voice
    max_streams_per_key: int = 16  # concurrent /v1/tts + live streams per API key (429 beyond)
    max_new_frames: int = 2048  # cap on max_new_tokens per text chunk
    # /v1/tts/live: seconds from the handshake to `start`, and of client silence while nothing
    # is being synthesized, before the session ends (its stream slot is freed).
    live_start_timeout: float = 10.0
    live_idle_timeout: float = 120.0
    # Bulk jobs (/v1/jobs): items per job (each item's text is capped by max_text_length),
    # unfinished jobs per tenant (429 beyond), engine requests in flight per job and in all.
    max_job_items: int = 1000
    max_jobs_per_tenant: int = 16
    job_concurrency: int = 2
    jobs_max_concurrency: int = 8
    # How long a server's claim on a job lasts without renewal (renewed every third of it while it
    # runs): when servers share a database, a dead server's jobs move to another after this.
    job_lease_seconds: float = 30.0
    # A local CTC model directory (wav2vec2-style) for word timestamps on
    # /v1/tts/stream/with-timestamp (server/alignment.py); None: text-chunk timings only.
    aligner: str | None = None

    @property
    def websocket_transport_max_bytes(self) -> int:
        """The server's WebSocket frame limit (uvicorn's `ws_max_size`): above `max_body_bytes`, so
        that a live message over the limit still reaches the session, which ends it with a
        `finish` event saying why; only a message over twice the limit is cut off by the
        transport (close code 1009, no event)."""
        return 2 * self.max_body_bytes
