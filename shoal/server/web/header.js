// The bar at the top of every page (navigation and the API key) and the page's message line.

import { describeError, storedKey, storeKey } from "./api.js";

const PAGES = [
  ["/", "Playground"],
  ["/dashboard", "Dashboard"],
  ["/voices", "Voices"],
];

export function element(tag, attributes = {}, children = []) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  node.append(...children);
  return node;
}

function keyState() {
  const key = storedKey();
  return key ? `key …${key.slice(-4)} kept for this tab` : "no key (fine with --no-auth)";
}

// Renders the bar into <header id="bar">; `onKeyChange` runs after the key is set or forgotten.
export function mountHeader(onKeyChange = () => {}) {
  const links = PAGES.map(([path, title]) => {
    const link = element("a", { href: path }, [title]);
    if (location.pathname === path) link.setAttribute("aria-current", "page");
    return link;
  });
  const input = element("input", {
    id: "api-key", type: "password", autocomplete: "off", placeholder: "API key", "aria-label": "API key",
  });
  const state = element("span", { id: "key-state", class: "muted" }, [keyState()]);
  const forget = element("button", { type: "button", id: "forget-key" }, ["Forget"]);
  const form = element("form", { id: "key-form", class: "key" }, [
    input, element("button", { type: "submit", id: "use-key" }, ["Use key"]), forget, state,
  ]);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    storeKey(input.value.trim());
    input.value = "";
    state.textContent = keyState();
    clearMessage();
    onKeyChange();
  });
  forget.addEventListener("click", () => {
    storeKey("");
    state.textContent = keyState();
    onKeyChange();
  });
  const bar = document.getElementById("bar");
  bar.append(element("strong", { class: "brand" }, ["Shoal"]), element("nav", {}, links), form);
}

// The one message line under the bar: errors stay until the next action clears them.
export function showMessage(text, kind = "error") {
  const box = document.getElementById("message");
  box.textContent = text;
  box.className = `message ${kind}`;
  box.hidden = false;
}

export function showError(error) {
  showMessage(describeError(error), "error");
}

export function clearMessage() {
  const box = document.getElementById("message");
  box.hidden = true;
  box.textContent = "";
}

