// The API key and every request the page makes. The key lives in this module's memory
// only (never in the URL, never in storage) and travels as `Authorization: Bearer`.

let apiKey = null;

export function setKey(key) {
  apiKey = key || null;
}

export function hasKey() {
  return apiKey !== null;
}

export class ApiError extends Error {
  constructor(status, message, retryAfter) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

export function headers(extra = {}) {
  const h = { ...extra };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

// fetch() that throws ApiError with the server's OpenAI-style message on a non-2xx.
export async function request(path, options = {}) {
  const init = { ...options, headers: headers(options.headers || {}) };
  const resp = await fetch(path, init);
  if (!resp.ok) {
    let message = `${resp.status} ${resp.statusText}`;
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (e) {
      // not JSON: keep the status line
    }
    const retry = Number(resp.headers.get("Retry-After")) || 0;
    throw new ApiError(resp.status, message, retry);
  }
  return resp;
}

export async function postJSON(path, body, signal) {
  const resp = await request(path, {
    method: "POST",
    body: JSON.stringify(body),
    headers: { "Content-Type": "application/json" },
    signal,
  });
  return resp;
}

// Bytes a frame may reach without a delimiter before the stream is given up (a server
// bug or a proxy gone wrong must not grow the page's memory without bound).
const MAX_FRAME_BYTES = 16 * 1024 * 1024;

// The `data:` payloads of a Server-Sent-Events body, one string per event.
export async function* sseData(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
      if (buf.length > MAX_FRAME_BYTES) throw new Error("state frame too large");
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}
