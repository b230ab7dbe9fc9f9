// The request timeline: running requests, then the last finished ones (newest first),
// each with a bar of where its prompt's KV came from: device prefix hit, an offload
// tier, a cached segment, or computed by the model; pressed tokens where a press ran.

const SOURCE_COLORS = {
  device: "#2f8f4e", tier: "#3b6fd1", segment: "#1a9e9e", computed: "#b9bec7",
  pressed: "#e8891c",
};

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function secs(v) {
  return v === null || v === undefined ? "–" : `${(v * 1000).toFixed(0)} ms`;
}

// A stacked bar of prompt tokens: [[label, tokens, colour], ...].
function sourceBar(parts, total) {
  const td = document.createElement("td");
  const bar = document.createElement("div");
  bar.className = "srcbar";
  const words = [];
  for (const [label, n, color] of parts) {
    if (!n) continue;
    const seg = document.createElement("span");
    seg.style.width = `${(100 * n) / Math.max(1, total)}%`;
    seg.style.background = color;
    seg.title = `${label}: ${n} tokens`;
    bar.append(seg);
    words.push(`${label} ${n}`);
  }
  const text = document.createElement("small");
  text.textContent = `${total} tok: ${words.join(", ") || "none"}`;
  td.append(bar, text);
  return td;
}

function finishedRow(r) {
  const tr = document.createElement("tr");
  const tier = Object.values(r.tier_tokens || {}).reduce((a, b) => a + b, 0);
  const tiers = Object.entries(r.tier_tokens || {}).map(([k, v]) => [k, v, SOURCE_COLORS.tier]);
  tr.append(
    cell(r.id.slice(0, 18), "mono"),
    cell(r.finish_reason || "done"),
    sourceBar(
      [
        ["device hit", r.device_hit_tokens, SOURCE_COLORS.device],
        ...tiers,
        ["segment", r.segment_tokens, SOURCE_COLORS.segment],
        ["computed", r.computed_tokens, SOURCE_COLORS.computed],
        ["pressed away", r.pressed_tokens, SOURCE_COLORS.pressed],
      ],
      r.prompt_tokens,
    ),
    cell(String(r.output_tokens)),
    cell(secs(r.ttft_s)),
    cell(secs(r.itl_s)),
    cell(r.output, "output"),
  );
  tr.dataset.tier = String(tier);
  return tr;
}

function runningRow(r) {
  const tr = document.createElement("tr");
  tr.className = "running";
  const computed = Math.max(0, Math.min(r.prompt_tokens, r.computed) - r.cached_tokens);
  const parts = [
    ["cached", r.cached_tokens, SOURCE_COLORS.device],
    ["computed", computed, SOURCE_COLORS.computed],
  ];
  if (r.pressed_tokens) parts.push(["pressed away", r.pressed_tokens, SOURCE_COLORS.pressed]);
  tr.append(
    cell(r.id.slice(0, 18), "mono"),
    cell("running"),
    sourceBar(parts, r.prompt_tokens),
    cell(String(r.output_tokens)),
    cell("–"),
    cell("–"),
    cell(""),
  );
  return tr;
}

export function drawTimeline(tbody, state) {
  const rows = [...state.running.map(runningRow), ...state.recent.slice().reverse().map(finishedRow)];
  tbody.replaceChildren(...rows);
}
