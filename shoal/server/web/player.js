// Playing audio while it is still arriving. Every player takes the live socket's `audio` payloads
// in order through push(bytes), and finish() resolves once the last sample has been heard.
//   pcm, wav: decoded here and scheduled back to back as Web Audio buffers (the lowest latency);
//   mp3:      appended to a MediaSource behind an <audio> element (the browser decodes it);
//   opus:     browsers cannot stream Ogg through MediaSource, so it plays once complete.

const LEAD_SECONDS = 0.1; // buffered before the first sample, and again after a gap

function concat(chunks) {
  const total = chunks.reduce((sum, chunk) => sum + chunk.length, 0);
  const joined = new Uint8Array(total);
  let offset = 0;
  for (const chunk of chunks) {
    joined.set(chunk, offset);
    offset += chunk.length;
  }
  return joined;
}

// Mono s16le at `sampleRate` as Web Audio buffers. A gap is a chunk that arrived after the
// audio before it had finished playing: the listener heard silence (an underrun).
export class PcmStreamPlayer {
  constructor(context, sampleRate) {
    this.streaming = true; // plays while the audio still arrives
    this.context = context;
    this.sampleRate = sampleRate;
    this.samples = 0;
    this.oddByte = null; // a sample split across two payloads
    this.nextStart = 0;
    this.startedAt = null;
    this.endedAt = null;
    this.gaps = 0;
    this.gapSeconds = 0;
    this.playing = new Set();
    this.finished = false;
    this.done = new Promise((resolve) => (this.resolveDone = resolve));
  }

  get hasAudio() {
    return this.samples > 0;
  }

  get audioSeconds() {
    return this.sampleRate ? this.samples / this.sampleRate : 0;
  }

  // From the first sample's start to the last one's end, gaps included.
  get playedSeconds() {
    return this.endedAt === null ? 0 : this.endedAt - this.startedAt;
  }

  push(bytes) {
    if (this.oddByte !== null) {
      bytes = concat([this.oddByte, bytes]);
      this.oddByte = null;
    }
    const usable = bytes.length - (bytes.length % 2);
    if (usable < bytes.length) this.oddByte = bytes.slice(usable);
    const count = usable / 2;
    if (count === 0) return;
    const view = new DataView(bytes.buffer, bytes.byteOffset, usable);
    const buffer = this.context.createBuffer(1, count, this.sampleRate);
    const channel = buffer.getChannelData(0);
    for (let index = 0; index < count; index++) channel[index] = view.getInt16(2 * index, true) / 32768;
    this.samples += count;
    this.schedule(buffer);
  }

  schedule(buffer) {
    const now = this.context.currentTime;
    if (this.nextStart < now + 0.005) {
      const start = now + LEAD_SECONDS;
      if (this.startedAt !== null) {
        this.gaps += 1;
        this.gapSeconds += start - this.nextStart;
      }
      this.nextStart = start;
    }
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    source.onended = () => {
      this.playing.delete(source);
      this.endedAt = Math.max(this.endedAt ?? 0, this.context.currentTime);
      this.settle();
    };
    source.start(this.nextStart);
    this.playing.add(source);
    if (this.startedAt === null) this.startedAt = this.nextStart;
    this.nextStart += buffer.duration;
  }

  finish() {
    this.finished = true;
    this.settle();
    return this.done;
  }

  settle() {
    if (this.finished && this.playing.size === 0) this.resolveDone();
  }

  stop() {
    for (const source of this.playing) source.stop();
    this.playing.clear();
    this.finished = true;
    this.resolveDone();
  }
}

// The RIFF header's sample rate and where the samples start; null until enough bytes came.
function parseWavHeader(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const tag = (at) => String.fromCharCode(...bytes.subarray(at, at + 4));
  if (bytes.length < 12) return null;
  if (tag(0) !== "RIFF" || tag(8) !== "WAVE") throw new Error("the wav stream has no RIFF header");
  let sampleRate = null;
  for (let at = 12; at + 8 <= bytes.length; ) {
    const size = view.getUint32(at + 4, true);
    if (tag(at) === "fmt " && at + 16 <= bytes.length) sampleRate = view.getUint32(at + 12, true);
    if (tag(at) === "data") return sampleRate ? { sampleRate, dataOffset: at + 8 } : null;
    at += 8 + size + (size % 2);
  }
  return null;
}

// A streamed wav (sizes unknown): its header, then the same samples as pcm.
export class WavStreamPlayer extends PcmStreamPlayer {
  constructor(context) {
    super(context, 0);
    this.header = new Uint8Array(0);
  }

  push(bytes) {
    if (this.sampleRate) {
      super.push(bytes);
      return;
    }
    this.header = concat([this.header, bytes]);
    const parsed = parseWavHeader(this.header);
    if (parsed === null) return;
    this.sampleRate = parsed.sampleRate;
    super.push(this.header.subarray(parsed.dataOffset));
    this.header = null;
  }
}

// Compressed audio the browser decodes itself as it is appended (mp3).
export class MediaSourcePlayer {
  constructor(audio, mimeType) {
    this.streaming = true;
    this.audio = audio;
    this.queue = [];
    this.bytes = 0;
    this.finished = false;
    this.gaps = 0;
    this.gapSeconds = 0;
    this.started = false;
    this.mediaSource = new MediaSource();
    this.mediaSource.addEventListener(
      "sourceopen",
      () => {
        this.sourceBuffer = this.mediaSource.addSourceBuffer(mimeType);
        this.sourceBuffer.addEventListener("updateend", () => this.pump());
        this.pump();
      },
      { once: true },
    );
    audio.src = URL.createObjectURL(this.mediaSource);
    audio.addEventListener("playing", () => (this.started = true));
    audio.addEventListener("waiting", () => {
      if (this.started && !this.finished) this.gaps += 1;
    });
    this.done = new Promise((resolve) => {
      audio.addEventListener("ended", resolve, { once: true });
      audio.addEventListener("error", resolve, { once: true });
      this.resolveDone = resolve;
    });
    audio.play().catch(() => {}); // starts once data arrives (the click allowed autoplay)
  }

  get hasAudio() {
    return this.bytes > 0;
  }

  push(bytes) {
    this.bytes += bytes.length;
    this.queue.push(bytes);
    this.pump();
  }

  pump() {
    if (!this.sourceBuffer || this.sourceBuffer.updating) return;
    if (this.queue.length) this.sourceBuffer.appendBuffer(this.queue.shift());
    else if (this.finished && this.mediaSource.readyState === "open") this.mediaSource.endOfStream();
  }

  finish() {
    this.finished = true;
    this.pump();
    return this.done;
  }

  stop() {
    this.audio.pause();
    this.finished = true;
    this.resolveDone();
  }
}

// Audio that can only be decoded whole (Ogg Opus): kept until the end, then played.
export class WholeFilePlayer {
  constructor(context) {
    this.streaming = false;
    this.context = context;
    this.chunks = [];
    this.gaps = 0;
    this.gapSeconds = 0;
    this.source = null;
  }

  get hasAudio() {
    return this.chunks.length > 0;
  }

  push(bytes) {
    this.chunks.push(bytes);
  }

  async finish() {
    if (!this.chunks.length) return;
    const buffer = await this.context.decodeAudioData(concat(this.chunks).buffer);
    this.source = this.context.createBufferSource();
    this.source.buffer = buffer;
    this.source.connect(this.context.destination);
    const ended = new Promise((resolve) => (this.source.onended = resolve));
    this.source.start();
    await ended;
  }

  stop() {
    this.source?.stop();
  }
}

// `audioElement` plays what MediaSource streams; `sampleRate` is pcm's (it has no header).
export function createPlayer(format, sampleRate, context, audioElement) {
  if (format === "pcm") return new PcmStreamPlayer(context, sampleRate);
  if (format === "wav") return new WavStreamPlayer(context);
  if (format === "mp3" && window.MediaSource?.isTypeSupported("audio/mpeg")) {
    return new MediaSourcePlayer(audioElement, "audio/mpeg");
  }
  return new WholeFilePlayer(context);
}

// The whole response as a file to replay or save: pcm gets a wav header, the rest is as sent.
export function audioFile(format, chunks, sampleRate) {
  const data = concat(chunks);
  if (format !== "pcm") {
    const types = { wav: "audio/wav", mp3: "audio/mpeg", opus: "audio/ogg" };
    return new Blob([data], { type: types[format] || "application/octet-stream" });
  }
  const header = new DataView(new ArrayBuffer(44));
  const text = (at, value) => [...value].forEach((c, i) => header.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF");
  header.setUint32(4, 36 + data.length, true);
  text(8, "WAVE");
  text(12, "fmt ");
  header.setUint32(16, 16, true);
  header.setUint16(20, 1, true); // PCM
  header.setUint16(22, 1, true); // mono
  header.setUint32(24, sampleRate, true);
  header.setUint32(28, sampleRate * 2, true);
  header.setUint16(32, 2, true);
  header.setUint16(34, 16, true);
  text(36, "data");
  header.setUint32(40, data.length, true);
  return new Blob([header, data], { type: "audio/wav" });
}

// The duration of a whole file, decoded by the browser (for formats the players cannot count).
export async function decodedSeconds(context, blob) {
  const buffer = await context.decodeAudioData(await blob.arrayBuffer());
  return buffer.duration;
}
