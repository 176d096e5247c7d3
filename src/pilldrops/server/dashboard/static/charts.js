// Hand-drawn SVG charts (no library): bars over a numeric x axis, and lines/areas. Every drawn mark is
// an SVG element with a class (`bar`, `line`, `area`) and a <title> tooltip, so it can be inspected.

const NS = "http://www.w3.org/2000/svg";
const W = 640, H = 220, M = { l: 64, r: 12, t: 12, b: 28 };

function el(tag, attrs = {}, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

function frame(host, label) {
  host.replaceChildren();
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label, class: "chart" });
  host.append(svg);
  return svg;
}

function axes(svg, x0, x1, ymax, xfmt, yfmt) {
  const g = el("g", { class: "axes" });
  const pw = W - M.l - M.r, ph = H - M.t - M.b;
  g.append(el("line", { x1: M.l, y1: M.t + ph, x2: M.l + pw, y2: M.t + ph, class: "axis" }));
  g.append(el("line", { x1: M.l, y1: M.t, x2: M.l, y2: M.t + ph, class: "axis" }));
  for (const f of [0, 0.5, 1]) {
    const y = M.t + ph * (1 - f);
    g.append(el("line", { x1: M.l, y1: y, x2: M.l + pw, y2: y, class: "grid" }));
    g.append(el("text", { x: M.l - 6, y: y + 4, "text-anchor": "end", class: "tick" }, yfmt(ymax * f)));
  }
  for (const f of [0, 0.5, 1]) {
    const anchor = f === 0 ? "start" : f === 1 ? "end" : "middle";
    g.append(el("text", { x: M.l + pw * f, y: H - 8, "text-anchor": anchor, class: "tick" },
      xfmt(x0 + (x1 - x0) * f)));
  }
  svg.append(g);
  return {
    x: (v) => M.l + (x1 > x0 ? (v - x0) / (x1 - x0) : 0) * pw,
    y: (v) => M.t + ph * (1 - (ymax > 0 ? v / ymax : 0)),
  };
}

function empty(host, label, message) {
  const svg = frame(host, label);
  svg.append(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty-chart" }, message));
}

// bars: [{x0, x1, y, title}]
export function barChart(host, { label, bars, xfmt, yfmt, emptyText }) {
  if (!bars.length || bars.every((b) => !b.y)) return empty(host, label, emptyText);
  const svg = frame(host, label);
  const x0 = Math.min(...bars.map((b) => b.x0)), x1 = Math.max(...bars.map((b) => b.x1));
  const ymax = Math.max(...bars.map((b) => b.y));
  const s = axes(svg, x0, x1, ymax, xfmt, yfmt);
  const g = el("g", { class: "bars" });
  for (const b of bars) {
    if (!b.y) continue;
    const x = s.x(b.x0), w = Math.max(1, s.x(b.x1) - x - 1);
    const r = el("rect", { x, y: s.y(b.y), width: w, height: s.y(0) - s.y(b.y), class: "bar" });
    r.append(el("title", {}, b.title));
    g.append(r);
  }
  svg.append(g);
}

// series: [{points: [[x, y]], cls, name, area}]; with `step` (the width of a bucket) each point is a
// level held over [x, x + step) instead of a point joined to the next by a slope
export function lineChart(host, { label, series, xfmt, yfmt, emptyText, step = 0 }) {
  const pts = series.flatMap((s) => s.points);
  if (!pts.length) return empty(host, label, emptyText);
  const svg = frame(host, label);
  const x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0])) + step;
  const ymax = Math.max(1, ...pts.map((p) => p[1]));
  const s = axes(svg, x0, x1, ymax, xfmt, yfmt);
  const f = (v) => v.toFixed(1);
  for (const ser of series) {
    if (!ser.points.length) continue;
    const d = step
      ? ser.points.map((p, i) => `${i ? "L" : "M"}${f(s.x(p[0]))},${f(s.y(p[1]))}H${f(s.x(p[0] + step))}`).join("")
      : ser.points.map((p, i) => `${i ? "L" : "M"}${f(s.x(p[0]))},${f(s.y(p[1]))}`).join("");
    if (ser.area) {
      const first = ser.points[0], last = ser.points[ser.points.length - 1];
      const a = el("path", { d: `${d}L${f(s.x(last[0] + step))},${s.y(0)}L${f(s.x(first[0]))},${s.y(0)}Z`,
        class: `area ${ser.cls}` });
      a.append(el("title", {}, ser.name));
      svg.append(a);
    }
    const line = el("path", { d, class: `line ${ser.cls}` });
    line.append(el("title", {}, ser.name));
    svg.append(line);
  }
  const legend = el("g", { class: "legend" });
  series.forEach((ser, i) => {
    legend.append(el("rect", { x: M.l + 8 + i * 150, y: M.t + 2, width: 10, height: 10, class: `swatch ${ser.cls}` }));
    legend.append(el("text", { x: M.l + 22 + i * 150, y: M.t + 11, class: "tick" }, ser.name));
  });
  svg.append(legend);
}
