// The page: asks for the API key when the server wants one (and shows no data without
// it), follows the state stream, and redraws the block map, charts, timeline and
// prefix tree from each snapshot. The key stays in memory (api.js).

import { hasKey, request, setKey } from "./api.js";
import { BlockMap } from "./blockmap.js";
import { Chart, ms, num, pct, Series } from "./charts.js";
import { Playground } from "./playground.js";
import { PrefixTree } from "./prefixes.js";
import { StateStream } from "./stream.js";
import { drawTimeline } from "./timeline.js";

const $ = (id) => document.getElementById(id);
const PREFIX_REFRESH_MS = 3000;

const series = {
  usage: new Series("usage", "#3b6fd1"),
  hit: new Series("hit rate", "#2f8f4e"),
  ttft50: new Series("p50", "#3b6fd1"),
  ttft99: new Series("p99", "#c4433a"),
  itl50: new Series("p50", "#3b6fd1"),
  itl99: new Series("p99", "#c4433a"),
  running: new Series("running", "#3b6fd1"),
  waiting: new Series("waiting", "#e8891c"),
  evict: new Series("evicted/s", "#c4433a"),
  tier: new Series("tier loads/s", "#7b3fbf"),
};
const charts = [];
let windowS = 300;
let previous = null; // the last snapshot's counters, for rates
let noticeTimer = null;
let prefixTimer = null;

function notice(text, sticky) {
  const el = $("notice");
  el.textContent = text;
  el.hidden = false;
  if (noticeTimer) clearTimeout(noticeTimer);
  noticeTimer = sticky ? null : setTimeout(() => (el.hidden = true), 4000);
}

function setConn(kind, text) {
  const el = $("conn");
  el.className = `conn conn-${kind}`;
  el.textContent = text;
}

function hideData() {
  $("main").hidden = true;
  const map = $("blockmap");
  delete map.dataset.totals;
  map.getContext("2d").clearRect(0, 0, map.width, map.height);
  $("summary").textContent = "";
  $("requests").querySelector("tbody").replaceChildren();
  $("prefix-tree").replaceChildren();
}

function askKey(message) {
  hideData();
  stream.stop();
  if (prefixTimer) clearInterval(prefixTimer);
  prefixTimer = null;
  $("key-message").textContent = message;
  $("key-panel").hidden = false;
  $("key-input").focus();
}

function onStatus(kind, text) {
  if (kind === "auth") {
    setConn("auth", "key needed");
    askKey(`The server refused the key (${text}). Enter the API key:`);
    return;
  }
  setConn(kind, text);
  if (kind === "down") notice(text, true);
  if (kind === "live" && text === "reconnected") notice("state stream reconnected", false);
  if (kind === "live") {
    $("key-panel").hidden = true;
    $("main").hidden = false;
    if (!prefixTimer) {
      refreshPrefixes();
      prefixTimer = setInterval(refreshPrefixes, PREFIX_REFRESH_MS);
    }
  }
}

function rate(c, key, dt) {
  if (!previous || dt <= 0) return null;
  return Math.max(0, (c[key] - previous.c[key]) / dt);
}

function onState(state) {
  const c = state.counters;
  const t = state.ts;
  const dt = previous ? t - previous.t : 0;
  series.usage.push(t, c.kv_usage);
  series.hit.push(t, c.prefix_hit_rate);
  series.ttft50.push(t, c.ttft_p50);
  series.ttft99.push(t, c.ttft_p99);
  series.itl50.push(t, c.itl_p50);
  series.itl99.push(t, c.itl_p99);
  series.running.push(t, c.num_running);
  series.waiting.push(t, c.num_waiting);
  series.evict.push(t, rate(c, "num_evicted_blocks", dt));
  series.tier.push(t, rate(c, "tier_hits", dt));
  previous = { t, c };
  for (const chart of charts) chart.draw(t, windowS);
  if (state.blocks) {
    const totals = blockMap.draw(state.blocks);
    const b = state.blocks;
    $("map-info").textContent =
      `${b.num_blocks} blocks of ${state.block_size} tokens` +
      (b.group > 1 ? `, ${b.group} per cell` : "") +
      ` · ${state.prefix_cache} prefix cache, ${state.eviction_policy} eviction`;
    $("summary").textContent =
      `used ${totals.used + totals.pressed} · cached ${totals.cached} · pinned ${totals.pinned} · free ${totals.free}`;
  } else {
    $("map-info").textContent = `${state.kv_layout} layout: no blocks to draw`;
  }
  $("summary").dataset.hitRate = String(c.prefix_hit_rate);
  drawTiers(state.tiers);
  drawTimeline($("requests").querySelector("tbody"), state);
  playground.setPresses(state.presses || []);
}

function drawTiers(tiers) {
  const names = Object.keys(tiers || {});
  $("tiers").replaceChildren(
    ...names.map((name) => {
      const t = tiers[name];
      const div = document.createElement("div");
      div.className = "tier";
      div.textContent = `${name}: ${t.num_blocks} blocks · ${t.hits} hits · ${t.stores} stores` +
        (t.errors ? ` · ${t.errors} errors` : "");
      return div;
    }),
  );
  if (!names.length) $("tiers").textContent = "no offload tiers configured";
}

function refreshPrefixes() {
  prefixes.refresh().catch((err) => {
    if (err.status === 401) askKey("The server refused the key. Enter the API key:");
    else notice(`prefix tree: ${err.message}`, false);
  });
}

const blockMap = new BlockMap($("blockmap"), $("tooltip"), $("legend"));
const prefixes = new PrefixTree($("prefix-tree"), $("prefix-info"), (text) => notice(text, false));
const playground = new Playground(() => refreshPrefixes());
const stream = new StateStream({ intervalMs: 500, onState, onStatus });

const box = $("charts");
charts.push(
  new Chart(box, "KV usage", [series.usage], { format: pct, fixedMax: 1 }),
  new Chart(box, "prefix hit rate", [series.hit], { format: pct, fixedMax: 1 }),
  new Chart(box, "TTFT", [series.ttft50, series.ttft99], { format: ms }),
  new Chart(box, "ITL", [series.itl50, series.itl99], { format: ms }),
  new Chart(box, "requests", [series.running, series.waiting], { format: num }),
  new Chart(box, "evictions and tier loads", [series.evict, series.tier], { format: num }),
);

$("window").addEventListener("change", (e) => {
  windowS = Number(e.target.value);
});
$("key-panel").addEventListener("submit", (e) => {
  e.preventDefault();
  setKey($("key-input").value);
  $("key-input").value = "";
  $("key-panel").hidden = true;
  setConn("wait", "connecting…");
  stream.start();
});
$("key-button").addEventListener("click", () => askKey("Enter the API key:"));

// Ask for the key first when the server wants one; else (or if the probe fails) just
// connect: a wrong or missing key still ends in the key prompt through a 401.
request("/v1/kv/view")
  .then((resp) => resp.json())
  .then((info) => {
    if (info.api_key_required && !hasKey()) askKey("This server needs an API key. It stays in this tab's memory only.");
    else stream.start();
  })
  .catch(() => stream.start());
