// The /v1/kv/state stream: read with fetch() (so the key goes in a header), parsed frame
// by frame, reconnected with a growing delay when it drops, and reported to the page:
//   onState(state)  every snapshot
//   onStatus(kind, text)  kind: "live" | "wait" | "down" | "auth"
// Only the newest frame is kept: the page redraws from it and forgets it.

import { ApiError, request, sseData } from "./api.js";

const MAX_DELAY_MS = 10000;

export class StateStream {
  constructor({ intervalMs = 500, onState, onStatus }) {
    this.intervalMs = intervalMs;
    this.onState = onState;
    this.onStatus = onStatus;
    this.controller = null;
    this.stopped = true;
    this.attempt = 0;
    this.timer = null;
  }

  start() {
    this.stop();
    this.stopped = false;
    this.attempt = 0;
    this.connect();
  }

  stop() {
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    if (this.controller) this.controller.abort();
    this.controller = null;
  }

  async connect() {
    const controller = new AbortController();
    this.controller = controller;
    let got = false;
    try {
      const resp = await request(`/v1/kv/state?interval_ms=${this.intervalMs}`, {
        signal: controller.signal,
      });
      for await (const data of sseData(resp)) {
        if (!got) {
          got = true;
          this.onStatus("live", this.attempt > 0 ? "reconnected" : "live");
          this.attempt = 0;
        }
        this.onState(JSON.parse(data));
      }
      if (!this.stopped) this.retry("the state stream ended", 0);
    } catch (err) {
      if (this.stopped || controller.signal.aborted) return;
      if (err instanceof ApiError && err.status === 401) {
        this.stopped = true;
        this.onStatus("auth", err.message);
        return;
      }
      const wait = err instanceof ApiError ? err.retryAfter * 1000 : 0;
      this.retry(err.message || String(err), wait);
    }
  }

  retry(reason, minDelay) {
    this.attempt += 1;
    const delay = Math.max(minDelay, Math.min(MAX_DELAY_MS, 500 * 2 ** this.attempt));
    const secs = (delay / 1000).toFixed(1);
    this.onStatus("down", `stream dropped (${reason}); reconnecting in ${secs} s, attempt ${this.attempt}`);
    this.timer = setTimeout(() => {
      this.timer = null;
      if (!this.stopped) {
        this.onStatus("wait", `reconnecting (attempt ${this.attempt})…`);
        this.connect();
      }
    }, delay);
  }
}
