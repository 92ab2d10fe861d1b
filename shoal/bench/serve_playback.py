"""What a listener hears from a stream, for the open-loop benchmark: how many seconds of audio each
received chunk makes playable, and whether playback, started at the first playable chunk, ever
runs dry (an underrun) before the next chunk arrives.

Playable audio per chunk, by format (computed after the run, off the timing path):
- pcm: whole 16-bit samples received so far / sample rate (a chunk may end mid-sample);
- wav: the same after the 44-byte streaming header;
- mp3: the bytes go through PyAV's mp3 parser and decoder chunk by chunk, as a player would
  feed them; a chunk's audio is the samples its bytes completed;
- opus (Ogg): no decoding: a chunk's audio is what the Ogg pages it completed add to the
  granule position (48 kHz samples; the OpusHead pre-skip is not audio), since a player can
  only decode whole pages.

Underrun: playback starts when the first chunk with audio arrives (for pcm and wav that is the
first byte) and plays continuously; chunk i (with audio) underruns when it arrives after the
audio received before it has played out. The player then waits for it (a stall) and resumes,
so stall seconds add up and later deadlines move by the stall.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

WAV_HEADER_BYTES = 44
OPUS_GRANULE_RATE = 48000  # Ogg Opus granule positions count 48 kHz samples whatever the rate
OGG_PAGE_HEADER = struct.Struct("<4sBBqIIIB")  # capture, version, type, granule, serial, seq, crc, segments


@dataclass(frozen=True)
class Playback:
    """One stream as a listener hears it; times in the arrivals' clock (seconds)."""

    start: float | None  # when the first chunk with audio arrived; None: no audio at all
    audio_seconds: float
    underruns: int  # chunks that arrived after the audio before them had played out
    stall_seconds: float  # total time the player waited for audio, after it started


def pcm_chunk_seconds(sizes: list[int], sample_rate: int, header_bytes: int = 0) -> list[float]:
    """Seconds of 16-bit mono audio each chunk completes, after `header_bytes` of header."""
    seconds, received, samples_before = [], 0, 0
    for size in sizes:
        received += size
        samples = max(0, received - header_bytes) // 2
        seconds.append((samples - samples_before) / sample_rate)
        samples_before = samples
    return seconds


def mp3_chunk_seconds(chunks: list[bytes]) -> list[float]:
    """Seconds each chunk of an mp3 stream completes, decoded chunk by chunk with PyAV."""
    import av

    codec = av.CodecContext.create("mp3", "r")
    seconds = []
    for chunk in chunks:
        seconds.append(sum(frame.samples / frame.sample_rate for frame in _decode(codec, codec.parse(chunk))))
    if seconds:  # whatever the parser and decoder still hold was complete with the last chunk
        tail = _decode(codec, codec.parse(None)) + list(codec.decode(None))
        seconds[-1] += sum(frame.samples / frame.sample_rate for frame in tail)
    return seconds


def _decode(codec, packets) -> list:
    return [frame for packet in packets for frame in codec.decode(packet)]


def opus_chunk_seconds(chunks: list[bytes]) -> list[float]:
    """Seconds each chunk of an Ogg Opus stream completes: the granule position of the last
    whole page received, less the pre-skip, at 48 kHz."""
    buffer = b""
    pre_skip = 0
    played = 0  # samples playable so far (granule - pre-skip)
    seconds = []
    for chunk in chunks:
        buffer += chunk
        before = played
        while len(buffer) >= OGG_PAGE_HEADER.size:
            capture, _, _, granule, _, _, _, segments = OGG_PAGE_HEADER.unpack_from(buffer)
            if capture != b"OggS":
                raise ValueError("not an Ogg stream (no OggS capture pattern where a page starts)")
            table_end = OGG_PAGE_HEADER.size + segments
            if len(buffer) < table_end:
                break
            page_end = table_end + sum(buffer[OGG_PAGE_HEADER.size : table_end])
            if len(buffer) < page_end:
                break
            body = buffer[table_end:page_end]
            if body.startswith(b"OpusHead"):
                pre_skip = struct.unpack_from("<H", body, 10)[0]
            elif granule >= 0:  # -1: no packet ends on this page
                played = max(played, granule - pre_skip)
            buffer = buffer[page_end:]
        seconds.append((played - before) / OPUS_GRANULE_RATE)
    return seconds


def chunk_seconds(audio_format: str, chunks: list[bytes], sample_rate: int) -> list[float]:
    """Seconds of audio each received chunk makes playable (see the module docstring)."""
    if audio_format == "pcm":
        return pcm_chunk_seconds([len(chunk) for chunk in chunks], sample_rate)
    if audio_format == "wav":
        return pcm_chunk_seconds([len(chunk) for chunk in chunks], sample_rate, WAV_HEADER_BYTES)
    if audio_format == "mp3":
        return mp3_chunk_seconds(chunks)
    if audio_format == "opus":
        return opus_chunk_seconds(chunks)
    raise ValueError(f"unknown format {audio_format!r}")


def playback(arrivals: list[float], seconds: list[float]) -> Playback:
    """Play the chunks (arrival time, seconds of audio) from the first one with audio on; count
    the chunks that arrive after the buffer ran dry and the time spent waiting for them."""
    start, played_out, underruns, stalled = None, 0.0, 0, 0.0
    for arrival, duration in zip(arrivals, seconds, strict=True):
        if duration <= 0:
            continue
        if start is None:
            start, played_out = arrival, arrival + duration
            continue
        if arrival > played_out:  # the buffer ran dry at played_out; playback resumes now
            underruns += 1
            stalled += arrival - played_out
            played_out = arrival
        played_out += duration
    return Playback(start, sum(seconds), underruns, stalled)
