// The live dashboard: GET /metrics on an interval (the same numbers Prometheus scrapes), shown
// as cards with small time-series plots; one group for the server and, when the metrics carry
// an `engine` label, one per engine. `?interval=MS` sets the refresh (default 2000).

import { apiFetch } from "./api.js";
import { drawSeries, formatNumber } from "./charts.js";
import { clearMessage, element, mountHeader, showError } from "./header.js";
import {
  bucketDelta, byLabel, groupByEngine, histogramBuckets, parseMetrics, quantile, total,
} from "./prometheus.js";

const WINDOW_SECONDS = 120; // what the plots show
const RECENT_SECONDS = 60; // first-audio percentiles over this window while it has observations
const PRIORITIES = ["realtime", "standard", "batch"];
const PLOT_COLOR = "#1f6feb";
const requestedInterval = Number(new URLSearchParams(location.search).get("interval"));
const INTERVAL_MS = requestedInterval >= 100 ? requestedInterval : 2000;

const seconds = (value) => (value === null ? "—" : `${formatNumber(value)} s`);
const milliseconds = (value) => (value === null ? "—" : `${Math.round(value * 1000)} ms`);

// Cards for the engine's load: the server's totals, and each engine's own with several.
const ENGINE_CARDS = [
  { id: "running", title: "Running batch", read: (s) => ({ value: total(s, "shoal_running_batch_size") }) },
  {
    id: "queue",
    title: "Queue depth",
    read: (s) => {
      const depth = byLabel(s, "shoal_queue_depth", "priority");
      const known = PRIORITIES.filter((priority) => priority in depth);
      return {
        value: total(s, "shoal_queue_depth"),
        detail: known.map((priority) => `${priority} ${depth[priority]}`).join(" · "),
      };
    },
  },
  { id: "frames", title: "Frames / s", read: (s) => ({ value: total(s, "shoal_frames_per_second") }) },
  {
    id: "kv-pages",
    title: "KV pages used",
    read: (s) => {
      const used = total(s, "shoal_kv_pages_used");
      const free = total(s, "shoal_kv_pages_free");
      const prefix = total(s, "shoal_prefix_cache_pages");
      const parts = [];
      if (free !== null) parts.push(`of ${used + free}`);
      if (prefix !== null) parts.push(`${prefix} voice prefixes`);
      return { value: used, detail: parts.join(" · ") };
    },
  },
  {
    id: "headroom",
    title: "Playback headroom (least)",
    format: seconds,
    read: (s) => {
      const admitting = total(s, "shoal_admitting");
      let detail = "";
      if (admitting !== null) detail = admitting ? "admitting new streams" : "holding new streams back";
      return { value: total(s, "shoal_min_headroom_seconds"), detail };
    },
  },
  {
    id: "underruns",
    title: "Underruns (streams)",
    read: (s) => {
      const gaps = total(s, "shoal_underrun_seconds_total");
      const detail = gaps === null ? "" : `${seconds(gaps)} of gaps heard`;
      return { value: total(s, "shoal_streams_underrun_total"), detail };
    },
  },
];

// Cards only the server as a whole has (API processes' counters and histograms).
const SERVER_CARDS = [
  {
    id: "first-audio",
    title: "Time to first audio p50 / p90 / p99",
    format: milliseconds,
    read: (s, history) => firstAudio(s, history),
  },
  { id: "streams", title: "Open streams", read: (s) => ({ value: total(s, "shoal_active_streams") }) },
  {
    id: "requests",
    title: "Requests / s",
    read: (s, history) => {
      const failed = s.filter((x) => x.name === "shoal_requests_total" && x.labels.status?.startsWith("5"));
      const errors = failed.reduce((sum, x) => sum + x.value, 0);
      const detail = `${errors} server errors (5xx) since start`;
      return { value: rate(s, history, "shoal_requests_total"), detail };
    },
  },
  {
    id: "audio",
    title: "Audio delivered / s",
    format: seconds,
    read: (s, history) => ({
      value: rate(s, history, "shoal_audio_seconds_total"),
      detail: `${seconds(total(s, "shoal_audio_seconds_total"))} since start`,
    }),
  },
];

// Per second since the previous scrape.
function rate(samples, history, name) {
  const previous = history.at(-2);
  const now = total(samples, name);
  const before = previous && total(previous.samples, name);
  if (now === null || before === null || before === undefined) return null;
  return Math.max(0, now - before) / ((history.at(-1).at - previous.at) / 1000);
}

function firstAudio(samples, history) {
  const name = "shoal_time_to_first_audio_seconds";
  const buckets = histogramBuckets(samples, name);
  const oldest = history.find((entry) => entry.at >= Date.now() - RECENT_SECONDS * 1000);
  const recent = oldest ? bucketDelta(buckets, histogramBuckets(oldest.samples, name)) : [];
  const useRecent = recent.length && recent.at(-1).count > 0;
  const chosen = useRecent ? recent : buckets;
  const count = chosen.length ? chosen.at(-1).count : 0;
  const [p50, p90, p99] = [0.5, 0.9, 0.99].map((q) => quantile(chosen, q));
  if (p50 === null) return { value: null, detail: "no audio sent yet" };
  const where = useRecent ? `last ${RECENT_SECONDS} s` : "since start";
  return {
    value: p50,
    text: [p50, p90, p99].map((value) => Math.round(value * 1000)).join(" / ") + " ms",
    detail: `${where}, n = ${count}; the plot: p50`,
  };
}

class Card {
  constructor(container, spec) {
    this.spec = spec;
    this.points = []; // [{ t, v }] over the plot's window
    this.valueNode = element("div", { class: "value" }, ["—"]);
    this.detailNode = element("div", { class: "detail" });
    this.canvas = element("canvas", { "aria-hidden": "true" });
    this.root = element("div", { class: "card", "data-metric": spec.id }, [
      element("div", { class: "title" }, [spec.title]), this.valueNode, this.detailNode, this.canvas,
    ]);
    container.append(this.root);
  }

  update(samples, history) {
    const reading = this.spec.read(samples, history);
    const format = this.spec.format || ((value) => formatNumber(value));
    const value = reading.value ?? null;
    this.valueNode.textContent = reading.text ?? format(value);
    this.valueNode.classList.toggle("several", reading.text !== undefined);
    if (value === null) delete this.valueNode.dataset.value;
    else this.valueNode.dataset.value = String(value);
    this.detailNode.textContent = reading.detail ?? "";
    const now = Date.now();
    this.points.push({ t: now, v: value });
    while (this.points[0].t < now - WINDOW_SECONDS * 1000) this.points.shift();
    drawSeries(this.canvas, [{ points: this.points, color: PLOT_COLOR }], WINDOW_SECONDS, now);
  }
}

// A titled group of cards: the server's, or one engine's.
class Group {
  constructor(parent, title, specs, engine = null) {
    this.title = title;
    this.heading = element("h2", {}, [title]);
    this.root = element("section", { class: "group" }, [this.heading]);
    if (engine !== null) this.root.dataset.engine = engine;
    const cards = element("div", { class: "cards" });
    this.root.append(cards);
    parent.append(this.root);
    this.cards = specs.map((spec) => new Card(cards, spec));
  }

  update(samples, history) {
    const up = total(samples, "shoal_engine_up");
    const state = up === null ? "" : ` · ${up ? "up" : "down or restarting"}`;
    this.heading.textContent = this.title + state;
    this.heading.classList.toggle("down", up === 0);
    for (const card of this.cards) card.update(samples, history);
  }
}

const history = []; // [{ at, samples }] of the server-wide samples, for rates and recent percentiles
const engineGroups = new Map();
const serverCards = [...ENGINE_CARDS, ...SERVER_CARDS];
const serverGroup = new Group(document.getElementById("groups"), "Server (all engines)", serverCards);

function showStatus(samples) {
  const up = total(samples, "shoal_engine_up");
  const status = document.getElementById("status");
  const engine = up ? "up" : "down or restarting";
  status.textContent = `Updated ${new Date().toLocaleTimeString()} · engine ${engine}`;
  status.classList.toggle("down", !up);
}

async function refresh() {
  let text;
  try {
    text = await (await apiFetch("/metrics")).text();
  } catch (error) {
    showError(error);
    document.getElementById("status").textContent = "No answer from /metrics";
    return;
  }
  clearMessage();
  const { server, engines } = groupByEngine(parseMetrics(text));
  history.push({ at: Date.now(), samples: server });
  while (history.length && history[0].at < Date.now() - WINDOW_SECONDS * 1000) history.shift();
  showStatus(server);
  serverGroup.update(server, history);
  for (const [engine, samples] of engines) {
    if (!engineGroups.has(engine)) {
      const title = `Engine ${engine}`;
      engineGroups.set(engine, new Group(document.getElementById("groups"), title, ENGINE_CARDS, engine));
    }
    engineGroups.get(engine).update(samples, history);
  }
}

async function poll() {
  await refresh();
  setTimeout(poll, INTERVAL_MS);
}

mountHeader();
document.getElementById("interval").textContent = `every ${INTERVAL_MS / 1000} s`;
poll();
