// Reading GET /metrics (the Prometheus text format) in the browser: samples, sums over labels,
// per-engine groups and quantiles from histogram buckets.

const SAMPLE_LINE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

function unescapeLabel(value) {
  return value.replace(/\\(.)/g, (_, character) => (character === "n" ? "\n" : character));
}

function parseValue(text) {
  if (text === "+Inf") return Infinity;
  if (text === "-Inf") return -Infinity;
  return Number(text);
}

// [{ name, labels, value }] for every sample line; comments and malformed lines are skipped.
export function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = SAMPLE_LINE.exec(line.trim());
    if (!match) continue;
    const labels = {};
    for (const [, name, value] of (match[2] || "").matchAll(LABEL)) labels[name] = unescapeLabel(value);
    samples.push({ name: match[1], labels, value: parseValue(match[3]) });
  }
  return samples;
}

// One engine's series under the names of the server-wide ones: a server with several engines
// labels each engine's series `engine` (`shoal_engine_running_batch_size{engine="0"}` is that
// engine's `shoal_running_batch_size`; `shoal_engine_process_up` its `shoal_engine_up`).
function engineName(name) {
  if (name === "shoal_engine_process_up") return "shoal_engine_up";
  return name.replace(/^shoal_engine_(?!up$)/, "shoal_");
}

// Splits the samples: `server` has every sample without an `engine` label; `engines` maps each
// engine label to its samples, renamed as above (empty with a single engine).
export function groupByEngine(samples) {
  const server = [];
  const engines = new Map();
  for (const sample of samples) {
    const engine = sample.labels.engine;
    if (engine === undefined) {
      server.push(sample);
      continue;
    }
    if (!engines.has(engine)) engines.set(engine, []);
    const { engine: _, ...labels } = sample.labels;
    engines.get(engine).push({ name: engineName(sample.name), labels, value: sample.value });
  }
  const ordered = [...engines].sort(([a], [b]) => a.localeCompare(b, "en", { numeric: true }));
  return { server, engines: new Map(ordered) };
}

// The sum of `name` over the samples whose labels include `match`; null when there is none.
export function total(samples, name, match = {}) {
  let sum = null;
  for (const sample of samples) {
    if (sample.name !== name) continue;
    if (Object.entries(match).some(([key, value]) => sample.labels[key] !== value)) continue;
    sum = (sum ?? 0) + sample.value;
  }
  return sum;
}

// Label value -> summed value, e.g. queue depth by priority.
export function byLabel(samples, name, label) {
  const values = {};
  for (const sample of samples) {
    if (sample.name !== name || sample.labels[label] === undefined) continue;
    values[sample.labels[label]] = (values[sample.labels[label]] ?? 0) + sample.value;
  }
  return values;
}

// A histogram's cumulative buckets summed over its other labels (routes): [{ le, count }] by le.
export function histogramBuckets(samples, name) {
  const counts = new Map();
  for (const sample of samples) {
    if (sample.name !== `${name}_bucket`) continue;
    const le = parseValue(sample.labels.le);
    counts.set(le, (counts.get(le) ?? 0) + sample.value);
  }
  return [...counts].map(([le, count]) => ({ le, count })).sort((a, b) => a.le - b.le);
}

// Bucket counts of `later` minus `earlier` (the observations between two scrapes).
export function bucketDelta(later, earlier) {
  const before = new Map(earlier.map(({ le, count }) => [le, count]));
  return later.map(({ le, count }) => ({ le, count: count - (before.get(le) ?? 0) }));
}

// As Prometheus's histogram_quantile: linear within the bucket that holds the rank; the last
// finite bound when the rank falls in +Inf. null without observations.
export function quantile(buckets, q) {
  if (!buckets.length) return null;
  const count = buckets[buckets.length - 1].count;
  if (!(count > 0)) return null;
  const rank = q * count;
  let lowerBound = 0;
  let lowerCount = 0;
  for (const { le, count: cumulative } of buckets) {
    if (cumulative >= rank) {
      if (le === Infinity) return lowerBound;
      const inBucket = cumulative - lowerCount;
      return inBucket > 0 ? lowerBound + ((le - lowerBound) * (rank - lowerCount)) / inBucket : le;
    }
    lowerBound = le;
    lowerCount = cumulative;
  }
  return lowerBound;
}
