// Calls to the Shoal API from the pages. The key lives in sessionStorage (this tab, until it
// closes) and travels in the Authorization header, or in a WebSocket subprotocol for the live
// socket, which cannot carry headers: never in a URL, where logs and history would keep it.

const KEY_STORAGE = "shoal.apiKey";
const LIVE_PROTOCOL = "shoal.live";
const KEY_PROTOCOL_PREFIX = "shoal.key.";

export function storedKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

export function storeKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

// An error the server answered (`status` from its `{"status", "message"}` body), or status 0
// when the server could not be reached at all.
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// One line a person can act on.
export function describeError(error) {
  if (!(error instanceof ApiError)) return `Error: ${error.message || error}`;
  const hint = error.status === 401 ? " (enter a valid API key at the top of the page)" : "";
  return error.status ? `Error ${error.status}: ${error.message}${hint}` : `Error: ${error.message}`;
}

async function errorFrom(response) {
  let message = `${response.status} ${response.statusText}`.trim();
  try {
    const body = await response.json();
    if (body && typeof body.message === "string") message = body.message;
  } catch {
    // not the JSON error body (a proxy's page, say): the status line is all there is
  }
  return new ApiError(response.status, message);
}

// fetch with the key; `json` or `form` (a FormData) is the body. Rejects with an ApiError.
export async function apiFetch(path, { method = "GET", json, form } = {}) {
  const headers = {};
  const key = storedKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (form !== undefined) {
    body = form;
  }
  let response;
  try {
    response = await fetch(path, { method, headers, body });
  } catch (error) {
    throw new ApiError(0, `cannot reach the server (${error.message})`);
  }
  if (!response.ok) throw await errorFrom(response);
  return response;
}

export async function apiJson(path, options) {
  return (await apiFetch(path, options)).json();
}

// Every voice the caller may use (own ones and everyone's public ones), page by page.
export async function listVoices() {
  const voices = [];
  for (let page = 1; page <= 20; page++) {
    const result = await apiJson(`/model?page_size=100&page_number=${page}&sort_by=created_at`);
    voices.push(...result.items);
    if (!result.has_more) break;
  }
  return voices;
}

// The caller's tenant (voices it owns have it as their author), or null when unknown.
export async function currentTenant() {
  try {
    return (await apiJson("/wallet/self/api-credit")).user_id;
  } catch {
    return null;
  }
}

function base64url(text) {
  let binary = "";
  for (const byte of new TextEncoder().encode(text)) binary += String.fromCharCode(byte);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

export function openLiveSocket() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const protocols = [LIVE_PROTOCOL];
  const key = storedKey();
  if (key) protocols.push(KEY_PROTOCOL_PREFIX + base64url(key));
  const socket = new WebSocket(`${scheme}//${location.host}/v1/tts/live`, protocols);
  socket.binaryType = "arraybuffer";
  return socket;
}
