// Small time-series plots on <canvas>: a few lines over the last `windowSeconds`, the y axis
// from 0 to a little above the largest value shown, which is written in the corner (drawn by
// hand: a plotting library would be the pages' largest file by far).

// lines: [{ points: [{ t, v }] (t in ms, oldest first, v null for a missing sample), color }]
export function drawSeries(canvas, lines, windowSeconds, now = Date.now()) {
  const ratio = window.devicePixelRatio || 1;
  const width = Math.max(1, Math.round(canvas.clientWidth * ratio));
  const height = Math.max(1, Math.round(canvas.clientHeight * ratio));
  if (canvas.width !== width || canvas.height !== height) {
    canvas.width = width;
    canvas.height = height;
  }
  const context = canvas.getContext("2d");
  context.clearRect(0, 0, width, height);
  // Until the window has filled, the plot spans from the first point to now.
  const first = Math.min(...lines.map((line) => line.points[0]?.t ?? now));
  const since = Math.max(now - windowSeconds * 1000, Math.min(first, now - 1000));
  const shown = (point) => point.t >= since && point.v !== null;
  const values = lines.flatMap((line) => line.points.filter(shown).map((point) => point.v));
  const largest = Math.max(...values, 0);
  const top = largest * 1.1 || 1;
  const x = (t) => ((t - since) / (now - since)) * width;
  const y = (v) => height - 1 - (v / top) * (height - 2);

  const style = getComputedStyle(canvas);
  context.strokeStyle = style.getPropertyValue("--line") || "#d9dde4";
  context.lineWidth = ratio;
  context.beginPath();
  context.moveTo(0, height - 0.5);
  context.lineTo(width, height - 0.5);
  context.stroke();

  context.lineWidth = 1.5 * ratio;
  for (const line of lines) {
    context.strokeStyle = line.color;
    context.beginPath();
    let drawing = false;
    for (const point of line.points) {
      if (point.t < since || point.v === null) {
        drawing = false;
        continue;
      }
      if (drawing) context.lineTo(x(point.t), y(point.v));
      else context.moveTo(x(point.t), y(point.v));
      drawing = true;
    }
    context.stroke();
  }

  if (largest > 0) {
    context.fillStyle = style.color;
    context.font = `${10 * ratio}px system-ui, sans-serif`;
    context.textBaseline = "top";
    context.fillText(formatNumber(largest), 2 * ratio, 1 * ratio);
  }
}

export function formatNumber(value, digits = 2) {
  if (value === null || value === undefined || Number.isNaN(value)) return "—";
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString("en");
  if (Number.isInteger(value)) return String(value);
  return value.toFixed(Math.abs(value) >= 100 ? 0 : digits);
}
