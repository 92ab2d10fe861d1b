// The voice library: list, rename, change visibility, delete, and play a voice's reference clip.

import { apiFetch, apiJson, currentTenant, listVoices } from "./api.js";
import { clearMessage, element, mountHeader, showError, showMessage } from "./header.js";

const VISIBILITIES = [
  ["private", "private"],
  ["unlist", "unlisted"],
  ["public", "public"],
];
const byId = (id) => document.getElementById(id);
let referenceUrl = null;

const voicePath = (voice) => `/model/${encodeURIComponent(voice._id)}`;

async function patchVoice(voice, fields, done) {
  const form = new FormData();
  for (const [name, value] of Object.entries(fields)) form.append(name, value);
  try {
    await apiJson(voicePath(voice), { method: "PATCH", form });
    showMessage(done, "info");
  } catch (error) {
    showError(error);
  }
  await load();
}

async function deleteVoice(voice) {
  if (!confirm(`Delete the voice "${voice.title}"? This cannot be undone.`)) return;
  try {
    await apiFetch(voicePath(voice), { method: "DELETE" });
    showMessage(`Deleted the voice "${voice.title}".`, "info");
  } catch (error) {
    showError(error);
  }
  await load();
}

async function playReference(voice) {
  clearMessage();
  const state = byId("reference-state");
  try {
    const response = await apiFetch(`${voicePath(voice)}/samples/0/audio`);
    if (referenceUrl) URL.revokeObjectURL(referenceUrl);
    referenceUrl = URL.createObjectURL(await response.blob());
  } catch (error) {
    showError(error);
    return;
  }
  const player = byId("reference-player");
  player.src = referenceUrl;
  player.dataset.voice = voice._id;
  state.dataset.state = "loading";
  state.textContent = `The reference of "${voice.title}"`;
  try {
    await player.play();
  } catch (error) {
    showMessage(`The browser cannot play this clip (${error.message}).`);
  }
}

function row(voice, tenant) {
  const own = tenant === null || voice.author?._id === tenant;
  const title = element("input", { class: "title", value: voice.title, "aria-label": "name" });
  const visibility = element("select", { "aria-label": "visibility" });
  for (const [value, label] of VISIBILITIES) {
    visibility.add(new Option(label, value, false, value === voice.visibility));
  }
  const rename = element("button", { type: "button", class: "rename" }, ["Rename"]);
  const remove = element("button", { type: "button", class: "delete danger" }, ["Delete"]);
  const play = element("button", { type: "button", class: "play" }, ["Play reference"]);
  for (const control of [title, visibility, rename, remove]) control.disabled = !own;

  rename.addEventListener("click", () => {
    const name = title.value.trim();
    if (!name) return showMessage("A voice needs a name.");
    patchVoice(voice, { title: name }, `Renamed "${voice.title}" to "${name}".`);
  });
  visibility.addEventListener("change", () => {
    const done = `"${voice.title}" is now ${visibility.selectedOptions[0].text}.`;
    patchVoice(voice, { visibility: visibility.value }, done);
  });
  remove.addEventListener("click", () => deleteVoice(voice));
  play.addEventListener("click", () => playReference(voice));

  const transcript = voice.samples?.[0]?.text || "";
  const created = new Date(voice.created_at).toLocaleString();
  return element("tr", { "data-voice-id": voice._id }, [
    element("td", {}, [title, element("br"), element("code", {}, [voice._id])]),
    element("td", {}, [visibility]),
    element("td", {}, [voice.author?.nickname ?? ""]),
    element("td", {}, [transcript]),
    element("td", {}, [created]),
    element("td", {}, [element("div", { class: "actions" }, [play, rename, remove])]),
  ]);
}

async function load() {
  const body = byId("voices");
  try {
    const [tenant, voices] = await Promise.all([currentTenant(), listVoices()]);
    body.replaceChildren(...voices.map((voice) => row(voice, tenant)));
    byId("empty").hidden = voices.length > 0;
  } catch (error) {
    body.replaceChildren();
    showError(error);
  }
}

const player = byId("reference-player");
player.addEventListener("playing", () => (byId("reference-state").dataset.state = "playing"));
player.addEventListener("ended", () => (byId("reference-state").dataset.state = "played"));
mountHeader(load);
byId("reload").addEventListener("click", () => {
  clearMessage();
  load();
});
load();
