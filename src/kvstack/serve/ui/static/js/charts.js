// Time series of the server's counters, drawn on small canvases by this file alone.
// Each series keeps at most MAX_POINTS samples (a ring): the page's memory is bounded
// however long it stays open.

const MAX_POINTS = 4000; // 15 min at 4 snapshots per second, plus slack

export class Series {
  constructor(label, color) {
    this.label = label;
    this.color = color;
    this.t = [];
    this.v = [];
  }

  push(t, v) {
    if (v === null || v === undefined || Number.isNaN(v)) return;
    this.t.push(t);
    this.v.push(v);
    if (this.t.length > MAX_POINTS) {
      this.t.shift();
      this.v.shift();
    }
  }

  last() {
    return this.v.length ? this.v[this.v.length - 1] : null;
  }
}

export class Chart {
  // series: Series[]; format: value -> text; fixedMax: y range top (null: from the data)
  constructor(container, title, series, { format = (v) => v.toFixed(2), fixedMax = null } = {}) {
    this.series = series;
    this.format = format;
    this.fixedMax = fixedMax;
    const box = document.createElement("figure");
    box.className = "chart";
    const cap = document.createElement("figcaption");
    this.caption = cap;
    this.title = title;
    this.canvas = document.createElement("canvas");
    this.canvas.width = 300;
    this.canvas.height = 90;
    box.append(cap, this.canvas);
    container.append(box);
  }

  draw(now, windowS) {
    const ctx = this.canvas.getContext("2d");
    const w = this.canvas.width;
    const h = this.canvas.height;
    ctx.clearRect(0, 0, w, h);
    const t0 = now - windowS;
    let max = this.fixedMax;
    if (max === null) {
      max = 0;
      for (const s of this.series) {
        for (let i = 0; i < s.t.length; i++) if (s.t[i] >= t0) max = Math.max(max, s.v[i]);
      }
      max = max > 0 ? max * 1.1 : 1;
    }
    ctx.strokeStyle = "#d0d4da";
    ctx.lineWidth = 1;
    ctx.strokeRect(0.5, 0.5, w - 1, h - 1);
    for (const s of this.series) {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let started = false;
      for (let i = 0; i < s.t.length; i++) {
        if (s.t[i] < t0) continue;
        const x = ((s.t[i] - t0) / windowS) * (w - 2) + 1;
        const y = h - 2 - (Math.min(s.v[i], max) / max) * (h - 4);
        if (started) ctx.lineTo(x, y);
        else ctx.moveTo(x, y);
        started = true;
      }
      ctx.stroke();
    }
    ctx.fillStyle = "#666";
    ctx.font = "10px sans-serif";
    ctx.fillText(`max ${this.format(max)}`, 4, 11);
    const values = this.series.map((s) => {
      const v = s.last();
      return `${s.label} ${v === null ? "–" : this.format(v)}`;
    });
    this.caption.textContent = `${this.title}: ${values.join(" · ")}`;
  }
}

export const pct = (v) => `${(v * 100).toFixed(1)}%`;
export const ms = (v) => `${(v * 1000).toFixed(1)} ms`;
export const num = (v) => (Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(1));
