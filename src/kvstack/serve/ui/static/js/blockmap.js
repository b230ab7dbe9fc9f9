// The block map: every device block (or, for big pools, every group of blocks the server
// aggregated) as one coloured cell on a canvas; hovering a cell says what it holds.
// Cell colours: free grey, used by a running request (one hue per request), cached and
// evictable (green: dark = kept longest, light = next victim), pinned purple, pressed orange,
// segments (tools, documents reused at any offset) teal.

const COLORS = {
  free: "#e4e6eb",
  pinned: "#7b3fbf",
  pressed: "#e8891c",
  segment: "#1f9fa8",
  cachedUnknown: "#4c9a5b",
};

export function cachedColor(rank) {
  if (rank < 0) return COLORS.cachedUnknown;
  const light = 28 + Math.round((rank / 255) * 45); // 28% (kept) .. 73% (next victim)
  return `hsl(135, 45%, ${light}%)`;
}

export function ownerColor(owner) {
  const hue = (owner * 137.508 + 200) % 360; // golden angle: neighbours differ
  return `hsl(${hue.toFixed(0)}, 65%, 52%)`;
}

export class BlockMap {
  constructor(canvas, tooltip, legend) {
    this.canvas = canvas;
    this.tooltip = tooltip;
    this.view = null;
    this.layout = null;
    canvas.addEventListener("mousemove", (e) => this.hover(e));
    canvas.addEventListener("mouseleave", () => {
      this.tooltip.hidden = true;
    });
    legend.replaceChildren(
      ...[
        ["free", COLORS.free],
        ["used (one colour per request)", ownerColor(0)],
        ["cached: dark kept longest, light evicted next", cachedColor(128)],
        ["pinned", COLORS.pinned],
        ["pressed", COLORS.pressed],
        ["segment (tool / document KV)", COLORS.segment],
      ].map(([label, color]) => {
        const item = document.createElement("span");
        const swatch = document.createElement("i");
        swatch.style.background = color;
        item.append(swatch, label);
        return item;
      }),
    );
  }

  // Totals per state over the whole pool (the page's summary, the tests' probe).
  totals(view) {
    const t = Object.fromEntries(view.states.map((s) => [s, 0]));
    if (view.group === 1) {
      for (const s of view.state) t[view.states[s]] += 1;
    } else {
      for (const counts of view.counts) counts.forEach((c, i) => (t[view.states[i]] += c));
    }
    return t;
  }

  color(view, i) {
    const name = view.states[view.state[i]];
    if (name === "used") return ownerColor(view.owner[i]);
    if (name === "cached") return cachedColor(view.rank[i]);
    return COLORS[name];
  }

  draw(view) {
    this.view = view;
    const canvas = this.canvas;
    const n = view.state.length;
    const width = canvas.clientWidth || canvas.width;
    const cols = Math.max(1, Math.ceil(Math.sqrt(n * (width / 300))));
    const size = Math.max(2, Math.floor(width / cols));
    const rows = Math.ceil(n / cols);
    const ratio = window.devicePixelRatio || 1;
    canvas.width = cols * size * ratio;
    canvas.height = Math.max(size, rows * size) * ratio;
    canvas.style.height = `${Math.max(size, rows * size)}px`;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const gap = size >= 6 ? 1 : 0;
    for (let i = 0; i < n; i++) {
      ctx.fillStyle = this.color(view, i);
      ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - gap, size - gap);
    }
    this.layout = { cols, size };
    const totals = this.totals(view);
    canvas.dataset.totals = JSON.stringify(totals);
    canvas.dataset.cells = String(n);
    return totals;
  }

  describe(i) {
    const v = this.view;
    const lo = i * v.group;
    const hi = Math.min(v.num_blocks, lo + v.group) - 1;
    const where = v.group === 1 ? `block ${lo}` : `blocks ${lo}–${hi}`;
    const state = v.states[v.state[i]];
    const parts = [where];
    if (v.group > 1) {
      parts.push(v.counts[i].map((c, s) => (c ? `${v.states[s]} ${c}` : "")).filter(Boolean).join(", "));
    } else {
      parts.push(state);
    }
    if (v.owner[i] >= 0) parts.push(`request ${v.request_ids[v.owner[i]]}`);
    if (v.rank[i] >= 0) parts.push(`eviction rank ${v.rank[i]}/255 (0: next victim)`);
    return parts.join(" · ");
  }

  hover(e) {
    if (!this.view || !this.layout) return;
    const rect = this.canvas.getBoundingClientRect();
    const { cols, size } = this.layout;
    const col = Math.floor((e.clientX - rect.left) / size);
    const row = Math.floor((e.clientY - rect.top) / size);
    const i = row * cols + col;
    if (col >= cols || i < 0 || i >= this.view.state.length) {
      this.tooltip.hidden = true;
      return;
    }
    this.tooltip.textContent = this.describe(i);
    this.tooltip.style.left = `${e.clientX - rect.left + 12}px`;
    this.tooltip.style.top = `${e.clientY - rect.top + 12}px`;
    this.tooltip.hidden = false;
  }
}
