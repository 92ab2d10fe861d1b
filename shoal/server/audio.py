"""Audio in and out, shared by the HTTP server and the CLI.

In: any upload PyAV/FFmpeg can read (wav, mp3, flac, ogg/opus, m4a/aac, webm) becomes mono
float32 at 44.1 kHz, or a clear `AudioDecodeError` the server turns into a 400/413.

Out: incremental encoders (`write(samples) -> bytes`, `finish() -> bytes`) for the four Fish API
formats and raw G.711 telephone audio (`mulaw`, `alaw`: 8-bit, 8 kHz, no header, what Twilio-style
media streams carry), so bytes reach the client while audio is still being generated, and the
concatenated bytes always form one valid file. Codecs are FFmpeg's (libmp3lame, libopus,
pcm_mulaw, pcm_alaw) through PyAV; resampling is libswresample (a windowed-sinc, band-limited
resampler); the speed change is libavfilter's pitch-keeping `atempo`.

Length tolerances after a decode round trip, relative to the input length at the output rate:
wav/pcm/mulaw/alaw exact (+-1 sample of resampler rounding); opus in ogg within 1 ms (pre-skip and end
trimming are written into the stream); mp3 never shorter and at most 2 frames (2 x 1152 samples)
longer, since a raw mp3 stream carries no gapless trim information.
"""

from __future__ import annotations

import io
import struct
from fractions import Fraction

import av
import av.filter
import numpy as np

SAMPLE_RATE = 44100  # the codec's rate and the default for wav, pcm and mp3
OPUS_SAMPLE_RATE = 48000
TELEPHONE_SAMPLE_RATE = 8000  # G.711 is defined at 8 kHz; mulaw and alaw are only made at this rate
G711_FORMATS = ("mulaw", "alaw")
FORMATS = ("wav", "pcm", "mp3", "opus", *G711_FORMATS)
# Other names clients use for a format (ElevenLabs and Cartesia say "ulaw"): accepted, answered
# as the canonical name.
FORMAT_ALIASES = {"ulaw": "mulaw"}
CONTENT_TYPES = {
    "wav": "audio/wav",
    "pcm": "application/octet-stream",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "mulaw": "audio/basic",  # RFC 2046: headerless 8-bit mu-law, 8 kHz, mono
    "alaw": "audio/x-alaw-basic",
}
FILE_EXTENSIONS = {"wav": "wav", "pcm": "pcm", "mp3": "mp3", "opus": "ogg", "mulaw": "ulaw", "alaw": "alaw"}
MP3_BITRATES_KBPS = (64, 128, 192)
MP3_SAMPLE_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)
OPUS_AUTO_BITRATE = -1000
OPUS_BITRATES_KBPS = (24, 32, 48, 64)
PCM_SAMPLE_RATE_RANGE = (8000, 192000)
DEFAULT_MAX_UPLOAD_SECONDS = 120.0
SILENCE_PEAK_DBFS = -60.0  # an upload whose loudest sample is below this is treated as silent
UNSIZED = 0xFFFFFFFF  # RIFF/data size of a streamed wav whose length is not known yet


class AudioDecodeError(ValueError):
    """An upload that cannot be used as a voice reference; `message` is shown to the user."""

    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class AudioTooLongError(AudioDecodeError):
    """The upload is longer than the configured limit (HTTP 413)."""

    status = 413


class AudioFormatError(ValueError):
    """An output format, sample rate or bitrate the encoders cannot produce (HTTP 400)."""


# ----------------------------------------------------------------------------------- decoding


def decode_audio(
    data: bytes,
    *,
    sample_rate: int = SAMPLE_RATE,
    max_seconds: float = DEFAULT_MAX_UPLOAD_SECONDS,
    silence_peak_dbfs: float = SILENCE_PEAK_DBFS,
) -> np.ndarray:
    """Decode an uploaded file to mono float32 at `sample_rate` (channels are averaged)."""
    if not data:
        raise AudioDecodeError("The uploaded audio is empty.")
    try:
        samples = _decode(data, sample_rate, max_seconds)
    except AudioDecodeError:
        raise
    except (av.FFmpegError, ValueError, EOFError) as error:
        raise AudioDecodeError(
            "Could not decode the uploaded audio; send a wav, mp3, flac, ogg/opus, m4a/aac or webm "
            f"file ({type(error).__name__}: {error})."
        ) from error
    if samples.size == 0:
        raise AudioDecodeError("The uploaded audio contains no samples (empty or truncated file).")
    peak = float(np.max(np.abs(samples)))
    if not np.isfinite(peak):
        raise AudioDecodeError("The uploaded audio contains invalid (NaN or infinite) samples.")
    if peak < 10.0 ** (silence_peak_dbfs / 20.0):
        raise AudioDecodeError(f"The uploaded audio is silent (peak below {silence_peak_dbfs:g} dBFS).")
    return samples


def _decode(data: bytes, sample_rate: int, max_seconds: float) -> np.ndarray:
    too_long = AudioTooLongError(f"The uploaded audio is longer than the {max_seconds:g} s limit.")
    with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
        if not container.streams.audio:
            raise AudioDecodeError("The uploaded file has no audio stream.")
        stream = container.streams.audio[0]
        if container.duration is not None and container.duration / av.time_base > max_seconds + 1.0:
            raise too_long  # reject from the header before decoding anything
        max_samples = int(max_seconds * sample_rate)
        resampler = av.AudioResampler(format="fltp", rate=sample_rate)  # keeps the channel layout
        pieces: list[np.ndarray] = []
        total = 0

        def collect(frames: list[av.AudioFrame]) -> None:
            nonlocal total
            for frame in frames:
                mono = frame.to_ndarray().mean(axis=0, dtype=np.float32)
                pieces.append(mono)
                total += mono.size
                if total > max_samples:
                    raise too_long

        for frame in container.decode(stream):
            collect(resampler.resample(frame))
        collect(resampler.resample(None))
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


# ----------------------------------------------------------------------------- shared helpers


def _frame(
    samples: np.ndarray, sample_rate: int, pts: int | None = None, sample_format: str = "flt"
) -> av.AudioFrame:
    """A mono float32 PyAV frame around `samples`. In mono, `flt` and `fltp` are the same bytes:
    build the frame in the encoder's own format, or PyAV converts every frame before encoding."""
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(samples, dtype=np.float32)[None, :], format=sample_format, layout="mono"
    )
    frame.sample_rate = sample_rate
    if pts is not None:
        frame.pts = pts
        frame.time_base = Fraction(1, sample_rate)
    return frame


def _as_mono_float(samples: np.ndarray) -> np.ndarray:
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim != 1:
        raise ValueError(f"expected mono samples of shape [n], got {samples.shape}")
    return samples


class _Resampler:
    """Streaming mono float32 rate conversion (libswresample); a pass-through at equal rates."""

    def __init__(self, input_rate: int, output_rate: int) -> None:
        self.input_rate = input_rate
        self._swr = None if input_rate == output_rate else av.AudioResampler("flt", "mono", output_rate)

    @property
    def passthrough(self) -> bool:
        return self._swr is None

    def process(self, samples: np.ndarray) -> np.ndarray:
        if self._swr is None or samples.size == 0:
            return samples
        return self._collect(self._swr.resample(_frame(samples, self.input_rate)))

    def flush(self) -> np.ndarray:
        return np.zeros(0, np.float32) if self._swr is None else self._collect(self._swr.resample(None))

    @staticmethod
    def _collect(frames: list[av.AudioFrame]) -> np.ndarray:
        if not frames:
            return np.zeros(0, np.float32)
        return np.concatenate([frame.to_ndarray()[0] for frame in frames])


def _pcm16(samples: np.ndarray) -> bytes:
    return np.clip(np.round(samples * 32767.0), -32768, 32767).astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte PCM s16 mono header; `data_bytes=None` writes the streaming 0xFFFFFFFF sizes."""
    riff_size = UNSIZED if data_bytes is None else 36 + data_bytes
    data_size = UNSIZED if data_bytes is None else data_bytes
    return (
        struct.pack("<4sI4s", b"RIFF", riff_size, b"WAVE")
        + struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + struct.pack("<4sI", b"data", data_size)
    )


# ----------------------------------------------------------------------------------- encoders


class AudioEncoder:
    """Incremental encoder: mono float32 in [-1, 1] at `input_sample_rate` in, file bytes out."""

    format: str
    plain_pcm = False  # the samples written as 16-bit PCM, no codec (`cheap`)
    sample_rate: int  # of the encoded output
    prosody: ProsodyTransform | None = None  # applied at the input rate, before resampling

    def __init__(self, input_sample_rate: int, sample_rate: int) -> None:
        self.input_sample_rate = input_sample_rate
        self.sample_rate = sample_rate
        self._resampler = _Resampler(input_sample_rate, sample_rate)

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES[self.format]

    @property
    def cheap(self) -> bool:
        """Whether `write` costs so little that a caller on an event loop should call it in place:
        16-bit PCM (raw or wav) at the input rate, no prosody (8 µs for an 8-frame chunk, where
        a hop to a worker thread costs about 90 µs; an mp3 chunk takes about 4.5 ms)."""
        return self.plain_pcm and self.prosody is None and self._resampler.passthrough

    def write(self, samples: np.ndarray) -> bytes:
        """Encode more audio; returns whatever bytes are ready (possibly none)."""
        samples = _as_mono_float(samples)
        if self.prosody is not None:
            samples = self.prosody.process(samples)
        return self._encode(self._resampler.process(samples))

    def finish(self) -> bytes:
        """Flush prosody, resampler and codec; returns the last bytes of the file."""
        tail = b"" if self.prosody is None else self._encode(self._resampler.process(self.prosody.finish()))
        return tail + self._encode(self._resampler.flush()) + self._close()

    def _encode(self, samples: np.ndarray) -> bytes:
        raise NotImplementedError

    def _close(self) -> bytes:
        return b""


class PcmEncoder(AudioEncoder):
    """Raw headerless s16le (the Fish `pcm` format)."""

    format = "pcm"
    plain_pcm = True

    def _encode(self, samples: np.ndarray) -> bytes:
        return _pcm16(samples)


class WavEncoder(AudioEncoder):
    """16-bit mono wav. Streaming: the header goes out first with unknown (0xFFFFFFFF) sizes.
    Not streaming: everything is held until `finish`, which returns one exactly sized file."""

    format = "wav"
    plain_pcm = True

    def __init__(self, input_sample_rate: int, sample_rate: int, streaming: bool = True) -> None:
        super().__init__(input_sample_rate, sample_rate)
        self.streaming = streaming
        self._header_sent = False
        self._held: list[bytes] = []

    def _encode(self, samples: np.ndarray) -> bytes:
        data = _pcm16(samples)
        if not self.streaming:
            self._held.append(data)
            return b""
        if not self._header_sent:
            self._header_sent = True
            return wav_header(self.sample_rate, None) + data
        return data

    def _close(self) -> bytes:
        if self.streaming:
            return b"" if self._header_sent else wav_header(self.sample_rate, 0)
        data = b"".join(self._held)
        self._held.clear()
        return wav_header(self.sample_rate, len(data)) + data


class Mp3Encoder(AudioEncoder):
    """Constant-bitrate mp3 frames from libmp3lame, which caps the bitrate at 160 kbps for
    16-24 kHz and at 64 kbps for 8-12 kHz (docs/api.md)."""

    format = "mp3"

    def __init__(self, input_sample_rate: int, sample_rate: int, bitrate_kbps: int = 128) -> None:
        super().__init__(input_sample_rate, sample_rate)
        self._codec = av.CodecContext.create("libmp3lame", "w")
        self._codec.sample_rate = sample_rate
        self._codec.layout = "mono"
        self._codec.format = "fltp"
        self._codec.bit_rate = bitrate_kbps * 1000
        self._codec.open()
        self._pts = 0

    def _encode(self, samples: np.ndarray) -> bytes:
        if samples.size == 0:
            return b""
        frame = _frame(samples, self.sample_rate, self._pts, self._codec.format.name)
        self._pts += samples.size
        return b"".join(bytes(packet) for packet in self._codec.encode(frame))

    def _close(self) -> bytes:
        return b"".join(bytes(packet) for packet in self._codec.encode(None))


class _ByteSink(io.RawIOBase):
    """Write-only file object that hands the muxer's output back to the caller as it arrives."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self._chunks.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data


class OpusEncoder(AudioEncoder):
    """Opus (libopus) in Ogg with 20 ms pages, so the stream flushes every few frames."""

    format = "opus"

    def __init__(self, input_sample_rate: int, sample_rate: int, bitrate_bps: int | None = None) -> None:
        # libopus resamples nothing itself; our resampler brings the audio to `sample_rate`.
        super().__init__(input_sample_rate, sample_rate)
        self._sink = _ByteSink()
        self._container = av.open(
            self._sink, mode="w", format="ogg", container_options={"page_duration": "20000"}
        )
        self._stream = self._container.add_stream("libopus", rate=sample_rate, layout="mono")
        if bitrate_bps is not None:
            self._stream.bit_rate = bitrate_bps
        self._container.start_encoding()  # the Ogg/Opus headers are ready before any audio
        self._pts = 0

    def _encode(self, samples: np.ndarray) -> bytes:
        if samples.size:
            frame = _frame(samples, self.sample_rate, self._pts)
            self._pts += samples.size
            self._container.mux(self._stream.encode(frame))
        return self._sink.take()

    def _close(self) -> bytes:
        self._container.mux(self._stream.encode(None))
        self._container.close()
        return self._sink.take()


class G711Encoder(AudioEncoder):
    """Raw headerless G.711 (one byte per sample) from FFmpeg's pcm_mulaw / pcm_alaw encoders,
    fed 16-bit PCM; a sample-wise codec, so every written sample comes straight back out."""

    codec_name: str

    def __init__(self, input_sample_rate: int, sample_rate: int = TELEPHONE_SAMPLE_RATE) -> None:
        super().__init__(input_sample_rate, sample_rate)
        self._codec = av.CodecContext.create(self.codec_name, "w")
        self._codec.sample_rate = sample_rate
        self._codec.layout = "mono"
        self._codec.format = "s16"
        self._codec.open()
        self._pts = 0

    def _encode(self, samples: np.ndarray) -> bytes:
        if samples.size == 0:
            return b""
        pcm = np.frombuffer(_pcm16(samples), dtype="<i2")[None, :]
        frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        frame.time_base = Fraction(1, self.sample_rate)
        self._pts += samples.size
        return b"".join(bytes(packet) for packet in self._codec.encode(frame))

    def _close(self) -> bytes:
        return b"".join(bytes(packet) for packet in self._codec.encode(None))


class MulawEncoder(G711Encoder):
    """G.711 mu-law (North America, Japan; Twilio Media Streams' `audio/x-mulaw`)."""

    format = "mulaw"
    codec_name = "pcm_mulaw"


class AlawEncoder(G711Encoder):
    """G.711 A-law (Europe and most international telephone networks)."""

    format = "alaw"
    codec_name = "pcm_alaw"


# ----------------------------------------------------------------------------------- prosody


class ProsodyTransform:
    """Streaming speed (0.5-2.0, pitch kept, libavfilter `atempo`) and volume (dB) change."""

    def __init__(self, sample_rate: int, speed: float = 1.0, volume_db: float = 0.0) -> None:
        if not 0.5 <= speed <= 2.0:
            raise AudioFormatError(f"speed must be between 0.5 and 2.0, got {speed:g}")
        self.sample_rate = sample_rate
        self.speed = speed
        self.gain = float(10.0 ** (volume_db / 20.0))
        self._graph: av.filter.Graph | None = None
        self._pts = 0
        if speed != 1.0:
            self._graph = av.filter.Graph()
            source = self._graph.add_abuffer(
                format="flt", sample_rate=sample_rate, layout="mono", time_base=Fraction(1, sample_rate)
            )
            tempo = self._graph.add("atempo", f"{speed:.6f}")
            sink = self._graph.add("abuffersink")
            source.link_to(tempo)
            tempo.link_to(sink)
            self._graph.configure()

    def process(self, samples: np.ndarray) -> np.ndarray:
        samples = _as_mono_float(samples)
        if self._graph is not None and samples.size:
            self._graph.push(_frame(samples, self.sample_rate, self._pts))
            self._pts += samples.size
            samples = self._drain()
        elif self._graph is not None:
            samples = np.zeros(0, np.float32)
        return self._apply_gain(samples)

    def finish(self) -> np.ndarray:
        if self._graph is None:
            return np.zeros(0, np.float32)
        self._graph.push(None)
        return self._apply_gain(self._drain())

    def _apply_gain(self, samples: np.ndarray) -> np.ndarray:
        if self.gain == 1.0:
            return samples
        return np.clip(samples * self.gain, -1.0, 1.0)  # a boost saturates instead of wrapping

    def _drain(self) -> np.ndarray:
        pieces = []
        while True:
            try:
                pieces.append(self._graph.pull().to_ndarray()[0])
            except (av.BlockingIOError, av.EOFError):
                break
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


# ---------------------------------------------------------------------------------- factories


def opus_bitrate_bps(value: int) -> int | None:
    """Fish's opus_bitrate, given in kbps (24) or bps (24000); -1000 means automatic (None)."""
    if value == OPUS_AUTO_BITRATE:
        return None
    bps = value * 1000 if 0 < value <= 510 else value
    if not 6000 <= bps <= 510000:
        raise AudioFormatError(f"opus_bitrate must be -1000 (auto) or 6-510 kbps, got {value}")
    return bps


def canonical_format(format: str) -> str:
    """The format's own name for an alias (`ulaw` -> `mulaw`); any other name unchanged."""
    return FORMAT_ALIASES.get(format, format)


def default_sample_rate(format: str) -> int:
    """The output rate when a request names none: 8 kHz for G.711, 48 kHz for opus, else 44.1 kHz."""
    format = canonical_format(format)
    if format in G711_FORMATS:
        return TELEPHONE_SAMPLE_RATE
    return OPUS_SAMPLE_RATE if format == "opus" else SAMPLE_RATE


def create_encoder(
    format: str,
    *,
    input_sample_rate: int = SAMPLE_RATE,
    sample_rate: int | None = None,
    mp3_bitrate: int = 128,
    opus_bitrate: int = OPUS_AUTO_BITRATE,
    speed: float = 1.0,
    volume_db: float = 0.0,
    streaming: bool = True,
) -> AudioEncoder:
    """The encoder for a Fish API request (`sample_rate=None`: `default_sample_rate(format)`)."""
    format = canonical_format(format)
    if format not in FORMATS:
        raise AudioFormatError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    rate = sample_rate or default_sample_rate(format)
    prosody = (
        None if speed == 1.0 and volume_db == 0.0 else ProsodyTransform(input_sample_rate, speed, volume_db)
    )
    encoder: AudioEncoder
    if format == "mp3":
        if rate not in MP3_SAMPLE_RATES:
            raise AudioFormatError(f"mp3 sample_rate must be one of {MP3_SAMPLE_RATES}, got {rate}")
        if mp3_bitrate not in MP3_BITRATES_KBPS:
            raise AudioFormatError(f"mp3_bitrate must be one of {MP3_BITRATES_KBPS}, got {mp3_bitrate}")
        encoder = Mp3Encoder(input_sample_rate, rate, mp3_bitrate)
    elif format == "opus":
        if rate not in OPUS_SAMPLE_RATES:
            raise AudioFormatError(f"opus sample_rate must be one of {OPUS_SAMPLE_RATES}, got {rate}")
        encoder = OpusEncoder(input_sample_rate, rate, opus_bitrate_bps(opus_bitrate))
    elif format in G711_FORMATS:
        if rate != TELEPHONE_SAMPLE_RATE:
            raise AudioFormatError(
                f"{format} is G.711 telephone audio, made at {TELEPHONE_SAMPLE_RATE} Hz only: omit "
                f"sample_rate or set it to {TELEPHONE_SAMPLE_RATE} (got {rate}); for another rate "
                "use pcm or wav"
            )
        encoder = (
            MulawEncoder(input_sample_rate, rate)
            if format == "mulaw"
            else AlawEncoder(input_sample_rate, rate)
        )
    else:
        low, high = PCM_SAMPLE_RATE_RANGE
        if not low <= rate <= high:
            raise AudioFormatError(f"{format} sample_rate must be in {low}..{high}, got {rate}")
        encoder = (
            WavEncoder(input_sample_rate, rate, streaming)
            if format == "wav"
            else PcmEncoder(input_sample_rate, rate)
        )
    encoder.prosody = prosody
    return encoder


def encode_audio(samples: np.ndarray, format: str, **options) -> bytes:
    """Encode a whole clip at once (a complete, exactly sized wav header for `wav`)."""
    encoder = create_encoder(format, streaming=False, **options)
    return encoder.write(samples) + encoder.finish()
