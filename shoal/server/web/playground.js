// The playground: type text, pick or create a voice, hear it while it is generated, and see
// the run's time to first audio, real-time factor and audio length.

import { apiJson, listVoices } from "./api.js";
import { clearMessage, mountHeader, showError, showMessage } from "./header.js";
import { speakLive } from "./live.js";
import { audioFile, createPlayer, decodedSeconds } from "./player.js";

const byId = (id) => document.getElementById(id);
const PCM_DEFAULT_RATE = 44100; // the server's default for pcm (docs/api.md)
const EXTENSIONS = { pcm: "wav", wav: "wav", mp3: "mp3", opus: "ogg" };

let audioContext = null;
let current = null; // { run, player } while a synthesis or its playback goes on
let replayUrl = null;

function setState(state, text) {
  const line = byId("run-state");
  line.dataset.state = state;
  line.textContent = text;
}

function setStat(id, value, text) {
  const cell = byId(id);
  if (value === null) delete cell.dataset.value;
  else cell.dataset.value = String(value);
  cell.textContent = text;
}

function resetStats() {
  for (const id of ["first-audio", "real-time-factor", "audio-length", "gaps"]) setStat(id, null, "—");
  byId("download").hidden = true;
  delete byId("run-state").dataset.playedSeconds;
  delete byId("run-state").dataset.gapSeconds;
}

async function loadVoices(selectId = null) {
  const select = byId("voice");
  const keep = selectId ?? select.value;
  try {
    const voices = await listVoices();
    select.replaceChildren(select.options[0]);
    for (const voice of voices) {
      const label = voice.visibility === "private" ? voice.title : `${voice.title} (${voice.visibility})`;
      select.add(new Option(label, voice._id));
    }
    select.value = voices.some((voice) => voice._id === keep) ? keep : "";
  } catch (error) {
    showError(error);
  }
}

function numberField(id) {
  const raw = byId(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

// The live `start` request: TTSRequest fields (docs/api.md); empty fields keep the defaults.
function requestFromForm() {
  const speed = numberField("speed") ?? 1;
  return {
    format: byId("format").value,
    sample_rate: numberField("sample-rate"),
    latency: byId("latency").value,
    temperature: numberField("temperature"),
    top_p: numberField("top-p"),
    seed: numberField("seed"),
    max_new_tokens: numberField("max-new-tokens"),
    reference_id: byId("voice").value || undefined,
    prosody: speed === 1 ? undefined : { speed, volume: 0 },
  };
}

function showFirstAudio(seconds) {
  setStat("first-audio", seconds, `${Math.round(seconds * 1000)} ms`);
}

function showAudioLength(seconds) {
  setStat("audio-length", seconds, `${seconds.toFixed(2)} s`);
}

function offerFile(format, chunks, sampleRate) {
  const blob = audioFile(format, chunks, sampleRate);
  if (replayUrl) URL.revokeObjectURL(replayUrl);
  replayUrl = URL.createObjectURL(blob);
  byId("replay").src = replayUrl;
  const link = byId("download");
  link.href = replayUrl;
  link.download = `shoal.${EXTENSIONS[format]}`;
  link.hidden = false;
  return blob;
}

async function speak() {
  clearMessage();
  const text = byId("text").value;
  if (!text.trim()) {
    showMessage("Type some text to speak first.");
    return;
  }
  // Created and resumed inside the click: browsers let only a user gesture start audio.
  audioContext ??= new AudioContext();
  audioContext.resume();
  const request = requestFromForm();
  const sampleRate = request.sample_rate ?? PCM_DEFAULT_RATE;
  const player = createPlayer(request.format, sampleRate, audioContext, byId("stream-audio"));
  resetStats();
  setState("generating", "Generating…");
  const run = speakLive(request, text, player, ({ firstAudioSeconds }) => {
    if (firstAudioSeconds !== null && byId("first-audio").dataset.value === undefined) {
      showFirstAudio(firstAudioSeconds);
      if (player.streaming) setState("playing", "Playing while generating…");
    }
    if (player.audioSeconds) showAudioLength(player.audioSeconds);
  });
  current = { run, player };
  byId("speak").disabled = true;
  byId("stop").disabled = false;
  try {
    const outcome = await run.result;
    if (outcome.cancelled) {
      setState("stopped", "Stopped");
      return;
    }
    if (!outcome.chunks.length) {
      setState("played", "Done: the server sent no audio");
      return;
    }
    const blob = offerFile(request.format, outcome.chunks, sampleRate);
    const seconds = player.audioSeconds || (await decodedSeconds(audioContext, blob));
    showAudioLength(seconds);
    const factor = outcome.wallSeconds / seconds;
    setStat("real-time-factor", factor, factor.toFixed(2));
    if (byId("first-audio").dataset.value === undefined && outcome.firstAudioSeconds !== null) {
      showFirstAudio(outcome.firstAudioSeconds);
    }
    setState("playing", player.streaming ? "Generated; playing the rest…" : "Generated; playing…");
    await player.finish();
    if (current?.player !== player) return; // stopped meanwhile
    const silence = player.gapSeconds ? ` · ${player.gapSeconds.toFixed(2)} s` : "";
    setStat("gaps", player.gaps, `${player.gaps}${silence}`);
    if (player.playedSeconds !== undefined) {
      // Heard from the first sample to the last, gaps included: what the browser really played.
      byId("run-state").dataset.playedSeconds = String(player.playedSeconds);
      byId("run-state").dataset.gapSeconds = String(player.gapSeconds);
    }
    setState("played", "Played");
  } catch (error) {
    player.stop();
    setState("failed", "Failed");
    showError(error);
  } finally {
    if (current?.player === player) current = null;
    byId("speak").disabled = false;
    byId("stop").disabled = true;
  }
}

function stop() {
  if (!current) return;
  current.run.cancel();
  current.player.stop();
  current = null;
  setState("stopped", "Stopped");
}

async function createVoice(event) {
  event.preventDefault();
  clearMessage();
  const form = new FormData();
  const title = byId("voice-title").value.trim();
  form.append("title", title);
  form.append("voices", byId("voice-file").files[0]);
  form.append("texts", byId("voice-text").value);
  form.append("visibility", byId("voice-visibility").value);
  const button = byId("create-voice");
  button.disabled = true;
  try {
    const voice = await apiJson("/model", { method: "POST", form });
    await loadVoices(voice._id);
    showMessage(`Created the voice "${voice.title}"; it is selected above.`, "info");
    byId("voice-form").reset();
  } catch (error) {
    showError(error);
  } finally {
    button.disabled = false;
  }
}

mountHeader(() => loadVoices());
byId("refresh-voices").addEventListener("click", () => loadVoices());
byId("speak").addEventListener("click", speak);
byId("stop").addEventListener("click", stop);
byId("voice-form").addEventListener("submit", createVoice);
loadVoices();
