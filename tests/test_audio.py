"""Upload decoding, streaming encoders and prosody in shoal.server.audio, checked by decoding
every produced byte stream back with PyAV (FFmpeg), independently of the encoder code."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest

from shoal.server.audio import (
    CONTENT_TYPES,
    MP3_BITRATES_KBPS,
    OPUS_AUTO_BITRATE,
    OPUS_BITRATES_KBPS,
    AudioDecodeError,
    AudioFormatError,
    AudioTooLongError,
    ProsodyTransform,
    create_encoder,
    decode_audio,
    encode_audio,
    opus_bitrate_bps,
)

RATE = 44100


def tone(seconds: float, rate: int = RATE, freq: float = 440.0, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    mono = (0.4 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    return mono if channels == 1 else np.stack([mono] * channels)


def decode_with_pyav(data: bytes) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and the decoder's output sample rate."""
    pieces, rate = [], 0
    to_float = av.AudioResampler(format="fltp")  # sample format only; rate and layout kept
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(audio=0):
            rate = frame.sample_rate
            pieces += [out.to_ndarray().mean(axis=0) for out in to_float.resample(frame)]
    return np.concatenate(pieces), rate


def encode_streaming(fmt: str, samples: np.ndarray, block: int = 2048, **options) -> list[bytes]:
    encoder = create_encoder(fmt, **options)
    chunks = [encoder.write(samples[i : i + block]) for i in range(0, len(samples), block)]
    return [*chunks, encoder.finish()]


def make_upload(container: str, codec: str, samples: np.ndarray, rate: int, layout: str) -> bytes:
    """An upload file written by PyAV in the given container/codec."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as output:
        stream = output.add_stream(codec, rate=rate, layout=layout)
        planar = np.ascontiguousarray(np.atleast_2d(samples), dtype=np.float32)
        frame = av.AudioFrame.from_ndarray(planar, format="fltp", layout=layout)
        frame.sample_rate = rate
        frame.pts = 0
        output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return buffer.getvalue()


# ------------------------------------------------------------------------------------ outputs


@pytest.mark.parametrize(
    ("fmt", "options", "decoded_rate"),
    [
        ("wav", {}, 44100),
        ("wav", {"sample_rate": 16000}, 16000),
        ("wav", {"sample_rate": 8000}, 8000),
        ("mp3", {}, 44100),
        ("mp3", {"sample_rate": 32000}, 32000),
        ("mp3", {"sample_rate": 22050, "mp3_bitrate": 64}, 22050),
        *[("mp3", {"mp3_bitrate": kbps}, 44100) for kbps in MP3_BITRATES_KBPS],
        ("opus", {}, 48000),
        # Opus always decodes at 48 kHz; a lower encode rate only narrows the bandwidth.
        ("opus", {"sample_rate": 24000}, 48000),
        *[("opus", {"opus_bitrate": kbps}, 48000) for kbps in (OPUS_AUTO_BITRATE, *OPUS_BITRATES_KBPS)],
        ("opus", {"opus_bitrate": 32000}, 48000),
    ],
)
def test_streamed_output_round_trips(fmt: str, options: dict, decoded_rate: int) -> None:
    samples = tone(1.337)  # not a whole number of codec frames at any rate
    data = b"".join(encode_streaming(fmt, samples, **options))
    decoded, rate = decode_with_pyav(data)
    assert rate == decoded_rate
    expected = len(samples) * decoded_rate / RATE
    if fmt == "wav":
        assert abs(len(decoded) - expected) <= 1
    elif fmt == "opus":
        assert abs(len(decoded) - expected) <= decoded_rate // 1000
    else:  # raw mp3: encoder delay and last-frame padding, never trimmed
        assert expected <= len(decoded) <= expected + 2 * 1152
    # Audio, not silence: the 440 Hz tone comes back loud.
    assert np.sqrt(np.mean(decoded**2)) > 0.15


def test_pcm_is_raw_s16le_at_the_requested_rate() -> None:
    samples = tone(0.5)
    raw = b"".join(encode_streaming("pcm", samples, sample_rate=24000))
    values = np.frombuffer(raw, "<i2")
    assert abs(len(values) - len(samples) * 24000 / RATE) <= 1
    assert 0.35 < np.abs(values).max() / 32767 < 0.45
    same_rate = b"".join(encode_streaming("pcm", samples))
    assert np.array_equal(np.frombuffer(same_rate, "<i2"), np.round(samples * 32767).astype(np.int16))


def test_streaming_wav_has_unknown_sizes_and_decodes() -> None:
    chunks = encode_streaming("wav", tone(1.0))
    assert chunks[0][:4] == b"RIFF" and chunks[0][8:12] == b"WAVE"
    riff_size, data_size = struct.unpack("<I", chunks[0][4:8])[0], struct.unpack("<I", chunks[0][40:44])[0]
    assert riff_size == data_size == 0xFFFFFFFF
    decoded, rate = decode_with_pyav(b"".join(chunks))
    assert rate == RATE and len(decoded) == RATE


def test_complete_wav_has_exact_sizes() -> None:
    samples = tone(0.25)
    data = encode_audio(samples, "wav")
    assert struct.unpack("<I", data[4:8])[0] == len(data) - 8
    assert struct.unpack("<I", data[40:44])[0] == 2 * len(samples) == len(data) - 44
    encoder = create_encoder("wav", streaming=False)
    assert encoder.write(samples) == b""  # held until the size is known
    assert encoder.finish() == data


@pytest.mark.parametrize("fmt", ["wav", "pcm", "mp3", "opus", "mulaw", "alaw"])
def test_bytes_come_out_before_finish(fmt: str) -> None:
    chunks = encode_streaming(fmt, tone(3.0), block=4410)
    before_finish = chunks[:-1]
    assert sum(len(chunk) for chunk in before_finish) > 0.8 * sum(len(chunk) for chunk in chunks)
    assert sum(1 for chunk in before_finish if chunk) >= len(before_finish) // 2


def test_empty_stream_is_still_a_valid_file() -> None:
    for fmt in ("wav", "opus"):
        encoder = create_encoder(fmt, streaming=False)
        data = encoder.finish()
        assert data  # a header (wav) or the ogg headers (opus)
    assert create_encoder("mp3").finish() == b""
    assert create_encoder("pcm").finish() == b""
    assert create_encoder("mulaw").finish() == create_encoder("alaw").finish() == b""


def test_output_validation() -> None:
    with pytest.raises(AudioFormatError):
        create_encoder("flac")
    with pytest.raises(AudioFormatError):
        create_encoder("mp3", mp3_bitrate=100)
    with pytest.raises(AudioFormatError):
        create_encoder("mp3", sample_rate=17000)
    with pytest.raises(AudioFormatError):
        create_encoder("opus", sample_rate=44100)
    with pytest.raises(AudioFormatError):
        create_encoder("opus", opus_bitrate=3)
    with pytest.raises(AudioFormatError):
        create_encoder("wav", speed=3.0)
    assert opus_bitrate_bps(-1000) is None
    assert opus_bitrate_bps(32) == opus_bitrate_bps(32000) == 32000


# ------------------------------------------------------------------------------------ prosody


@pytest.mark.parametrize("speed", [0.5, 0.8, 1.5, 2.0])
def test_speed_changes_length_but_keeps_pitch(speed: float) -> None:
    samples = tone(2.0, freq=440.0)
    transform = ProsodyTransform(RATE, speed=speed)
    pieces = [transform.process(samples[i : i + 4410]) for i in range(0, len(samples), 4410)]
    assert sum(len(piece) for piece in pieces) > 0  # streaming, not all at the end
    out = np.concatenate([*pieces, transform.finish()])
    assert abs(len(out) - len(samples) / speed) < 0.02 * len(samples)
    middle = out[len(out) // 4 : 3 * len(out) // 4]
    crossings_per_second = np.sum(np.diff(np.sign(middle)) != 0) / 2 / (len(middle) / RATE)
    assert abs(crossings_per_second - 440.0) < 5.0


def test_volume_in_decibels() -> None:
    samples = tone(0.2)
    quieter = ProsodyTransform(RATE, volume_db=-6.0).process(samples)
    np.testing.assert_allclose(quieter, samples * 10 ** (-6 / 20), rtol=1e-6)


def test_prosody_through_the_encoder() -> None:
    data = b"".join(encode_streaming("wav", tone(2.0), speed=2.0, volume_db=6.0))
    decoded, _ = decode_with_pyav(data)
    assert abs(len(decoded) - RATE) < 0.02 * RATE
    assert 0.7 < np.abs(decoded).max() < 0.85  # 0.4 * 10^(6/20) = 0.798


# ------------------------------------------------------------------------------------- inputs


@pytest.mark.parametrize(
    ("container", "codec", "rate", "layout"),
    [
        ("wav", "pcm_s16le", 16000, "mono"),
        ("wav", "pcm_f32le", 48000, "stereo"),
        ("mp3", "libmp3lame", 44100, "stereo"),
        ("flac", "flac", 22050, "mono"),
        ("ogg", "libopus", 48000, "mono"),
        ("ipod", "aac", 44100, "stereo"),  # .m4a
        ("webm", "libopus", 48000, "stereo"),
    ],
)
def test_every_input_format_decodes_to_mono_44k(container: str, codec: str, rate: int, layout: str) -> None:
    channels = 2 if layout == "stereo" else 1
    upload = make_upload(container, codec, tone(1.0, rate, channels=channels), rate, layout)
    samples = decode_audio(upload)
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(len(samples) - RATE) < 0.06 * RATE  # lossy codecs add their padding
    assert 0.3 < np.abs(samples).max() < 0.5


def test_stereo_is_averaged_and_resampled_exactly() -> None:
    left, right = tone(0.5, 16000), tone(0.5, 16000, freq=0.0)  # right channel silent
    upload = make_upload("wav", "pcm_f32le", np.stack([left, right]), 16000, "stereo")
    samples = decode_audio(upload)
    assert abs(len(samples) - RATE // 2) <= 1
    assert 0.18 < np.abs(samples).max() < 0.22


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (b"this is not audio at all" * 50, "decode"),
        (bytes(range(256)) * 40, "decode"),
    ],
)
def test_garbage_and_empty_uploads_fail_cleanly(data: bytes, reason: str) -> None:
    with pytest.raises(AudioDecodeError, match=reason) as caught:
        decode_audio(data)
    assert caught.value.status == 400


def test_truncated_uploads_fail_cleanly() -> None:
    wav = encode_audio(tone(1.0), "wav")
    m4a = make_upload("ipod", "aac", tone(1.0), RATE, "mono")
    for truncated in (wav[:30], wav[:44], m4a[: len(m4a) // 3]):
        with pytest.raises(AudioDecodeError):
            decode_audio(truncated)


def test_too_long_upload_is_413() -> None:
    upload = encode_audio(tone(3.0), "wav")
    with pytest.raises(AudioTooLongError) as caught:
        decode_audio(upload, max_seconds=2.0)
    assert caught.value.status == 413
    # A stream whose header declares no length is stopped while decoding.
    streamed = b"".join(encode_streaming("wav", tone(3.0)))
    with pytest.raises(AudioTooLongError):
        decode_audio(streamed, max_seconds=2.0)
    assert len(decode_audio(upload, max_seconds=5.0)) == 3 * RATE


def test_silent_upload_is_rejected() -> None:
    with pytest.raises(AudioDecodeError, match="silent"):
        decode_audio(encode_audio(np.zeros(RATE, np.float32), "wav"))
    with pytest.raises(AudioDecodeError, match="silent"):
        decode_audio(encode_audio(np.full(RATE, 1e-4, np.float32), "wav"))


def test_cheap_encoders_are_pcm_and_wav_at_the_input_rate_without_prosody():
    """`AudioEncoder.cheap`: the server calls these in place instead of on a worker thread."""
    assert create_encoder("wav").cheap and create_encoder("pcm").cheap
    assert create_encoder("wav", streaming=False).cheap
    assert not create_encoder("wav", sample_rate=16000).cheap  # resampling
    assert not create_encoder("pcm", speed=1.2).cheap  # prosody
    assert not create_encoder("mp3").cheap and not create_encoder("opus").cheap
    assert not create_encoder("mulaw").cheap  # always resampled to 8 kHz


# ------------------------------------------------------------------ telephone audio, resampling


def decode_raw_g711(data: bytes, fmt: str) -> np.ndarray:
    """Headerless G.711 bytes decoded by FFmpeg's own demuxer (`mulaw` / `alaw`), as int16."""
    pieces = []
    with av.open(io.BytesIO(data), format=fmt, options={"sample_rate": "8000"}) as container:
        for frame in container.decode(audio=0):
            assert frame.sample_rate == 8000
            pieces.append(frame.to_ndarray()[0])
    return np.concatenate(pieces).astype(np.int64)


def dominant_frequency(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum) * rate / len(samples))


@pytest.mark.parametrize("fmt", ["mulaw", "alaw", "ulaw"])
def test_g711_is_8_bit_8_khz_within_quantization_of_the_same_pcm(fmt: str) -> None:
    samples = tone(1.337, freq=1000.0)
    data = b"".join(encode_streaming(fmt, samples))
    assert abs(len(data) - len(samples) * 8000 / RATE) <= 1  # one byte per sample, 8 kHz
    decoded = decode_raw_g711(data, "alaw" if fmt == "alaw" else "mulaw")
    pcm = np.frombuffer(encode_audio(samples, "pcm", sample_rate=8000), "<i2").astype(np.int64)
    assert len(decoded) == len(pcm) == len(data)
    # G.711 keeps about 4 bits of mantissa: the error stays within 1/16 of the sample (+ the
    # smallest step); a wrong table, bit order or rate would be off by far more.
    assert np.all(np.abs(decoded - pcm) <= np.abs(pcm) / 16 + 12)
    assert dominant_frequency(decoded.astype(np.float64), 8000) == pytest.approx(1000.0, abs=2.0)
    assert create_encoder(fmt).content_type == CONTENT_TYPES["alaw" if fmt == "alaw" else "mulaw"]


def test_g711_streamed_equals_whole_and_is_made_at_8_khz_only() -> None:
    samples = tone(0.7)
    for fmt in ("mulaw", "alaw"):
        assert b"".join(encode_streaming(fmt, samples, block=1000)) == encode_audio(samples, fmt)
        assert create_encoder(fmt).sample_rate == create_encoder(fmt, sample_rate=8000).sample_rate == 8000
        for rate in (16000, 44100):
            with pytest.raises(AudioFormatError, match="8000"):
                create_encoder(fmt, sample_rate=rate)
    assert CONTENT_TYPES["mulaw"] == "audio/basic" and CONTENT_TYPES["alaw"] == "audio/x-alaw-basic"


@pytest.mark.parametrize("rate", [8000, 16000, 24000])
def test_resampled_pcm_keeps_a_sine_and_drops_what_the_rate_cannot_carry(rate: int) -> None:
    """libswresample is a band-limited resampler: a tone below the new Nyquist frequency comes
    through at its level and pitch; one above it is filtered out, where dropping samples would
    fold it back into the band at full level."""
    kept = tone(1.0, freq=1000.0)
    out = np.frombuffer(b"".join(encode_streaming("pcm", kept, sample_rate=rate)), "<i2") / 32767
    assert abs(len(out) - rate) <= 1
    assert dominant_frequency(out, rate) == pytest.approx(1000.0, abs=2.0)
    assert np.sqrt(np.mean(out[100:-100] ** 2)) == pytest.approx(0.4 / np.sqrt(2), rel=0.01)
    above_nyquist = tone(1.0, freq=0.7 * rate)
    folded = np.frombuffer(b"".join(encode_streaming("pcm", above_nyquist, sample_rate=rate)), "<i2") / 32767
    assert np.sqrt(np.mean(folded[100:-100] ** 2)) < 1e-3  # the edges hold the onset's click
