// One synthesis over the live WebSocket (/v1/tts/live, docs/api.md): `start` with the settings,
// the text, `stop`; every `audio` payload goes to the player as it arrives, until `finish`.

import { ApiError, openLiveSocket } from "./api.js";
import { decode, encode } from "./msgpack.js";

function closedEarly(close) {
  if (close.code === 1006) return "the live socket could not connect, or the connection was cut";
  const reason = close.reason ? `: ${close.reason}` : "";
  return `the live socket closed before the audio was complete (code ${close.code}${reason})`;
}

// Returns { result, cancel }. `result` resolves to { chunks, firstAudioSeconds, wallSeconds,
// cancelled } (times from sending the text) or rejects with an ApiError carrying the server's
// message. `onAudio()` runs after each payload reached the player.
export function speakLive(request, text, player, onAudio = () => {}) {
  const socket = openLiveSocket();
  const chunks = [];
  let sentAt = null;
  let firstAudioAt = null;
  let settled = false;
  let cancel;
  const result = new Promise((resolve, reject) => {
    const end = (outcome) => {
      if (settled) return;
      settled = true;
      if (outcome instanceof Error) reject(outcome);
      else resolve(outcome);
      if (socket.readyState <= WebSocket.OPEN) socket.close(1000);
    };
    const timings = () => ({
      chunks,
      firstAudioSeconds: firstAudioAt === null ? null : (firstAudioAt - sentAt) / 1000,
      wallSeconds: (performance.now() - sentAt) / 1000,
    });
    socket.onopen = () => {
      sentAt = performance.now();
      socket.send(encode({ event: "start", request: { ...request, text: "" } }));
      socket.send(encode({ event: "text", text }));
      socket.send(encode({ event: "stop" }));
    };
    socket.onmessage = (message) => {
      let event;
      try {
        event = decode(new Uint8Array(message.data));
      } catch (error) {
        end(new ApiError(0, `an unreadable message from the server (${error.message})`));
        return;
      }
      if (event.event === "audio" && event.audio?.length) {
        chunks.push(event.audio);
        player.push(event.audio);
        if (firstAudioAt === null && player.hasAudio) firstAudioAt = performance.now();
        onAudio(timings());
      } else if (event.event === "finish") {
        if (event.reason !== "error") end({ ...timings(), cancelled: false });
        else end(new ApiError(event.status || 0, event.message || "synthesis failed"));
      }
    };
    socket.onclose = (close) => end(new ApiError(0, closedEarly(close)));
    cancel = () => end({ ...timings(), cancelled: true }); // closing the socket aborts the request
  });
  return { result, cancel };
}
