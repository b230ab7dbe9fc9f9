// The chat playground: /v1/chat/completions with stream: true through fetch(), every
// sampling option of the form, per-request kv_press / kv_press_ratio / cache_salt,
// JSON output and tools (tool_choice auto / required / none; a reply's tool calls are shown
// and kept in the conversation as the assistant's tool_calls); after each reply the
// cached-token split of its prompt.

import { postJSON, sseData } from "./api.js";

const MAX_MESSAGES = 64; // the conversation kept in the page (oldest turns dropped)
const $ = (id) => document.getElementById(id);

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

// The request body from the form; throws Error with a message for bad JSON fields.
export function buildBody(messages) {
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  const nums = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "kv_press_ratio"];
  for (const name of nums) {
    const v = number(`opt-${name}`);
    if (v !== null && !Number.isNaN(v)) body[name] = v;
  }
  const stop = $("opt-stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) body.stop = stop;
  const press = $("opt-kv_press").value;
  if (press) body.kv_press = press;
  const salt = $("opt-cache_salt").value;
  if (salt) body.cache_salt = salt;
  const fmt = $("opt-response_format").value;
  if (fmt === "json_object") body.response_format = { type: "json_object" };
  if (fmt === "json_schema") {
    const schema = JSON.parse($("opt-schema").value || "{}");
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
  }
  const tools = $("opt-tools").value.trim();
  if (tools) {
    body.tools = JSON.parse(tools);
    const choice = $("opt-tool_choice").value;
    if (choice) body.tool_choice = choice;
    if (!$("opt-parallel_tool_calls").checked) body.parallel_tool_calls = false;
  }
  return body;
}

export class Playground {
  constructor(onDone) {
    this.messages = [];
    this.controller = null;
    this.onDone = onDone;
    $("chat-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    $("stop").addEventListener("click", () => this.controller && this.controller.abort());
    $("clear").addEventListener("click", () => {
      this.messages = [];
      $("chat").replaceChildren();
      $("usage").textContent = "";
    });
    $("opt-response_format").addEventListener("change", (e) => {
      $("opt-schema").hidden = e.target.value !== "json_schema";
    });
  }

  setPresses(names) {
    const select = $("opt-kv_press");
    if (select.options.length > 1) return;
    for (const name of names) select.append(new Option(name, name));
  }

  bubble(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    div.textContent = text;
    $("chat").append(div);
    while ($("chat").children.length > 2 * MAX_MESSAGES) $("chat").firstElementChild.remove();
    $("chat").scrollTop = $("chat").scrollHeight;
    return div;
  }

  async send() {
    const text = $("prompt").value.trim();
    if (!text || this.controller) return;
    const system = $("system").value.trim();
    this.messages.push({ role: "user", content: text });
    this.messages = this.messages.slice(-MAX_MESSAGES);
    const messages = system ? [{ role: "system", content: system }, ...this.messages] : this.messages;
    let body;
    try {
      body = buildBody(messages);
    } catch (err) {
      $("usage").textContent = `bad JSON in a field: ${err.message}`;
      this.messages.pop();
      return;
    }
    this.bubble("user", text);
    $("prompt").value = "";
    const out = this.bubble("assistant", "");
    out.classList.add("streaming");
    this.controller = new AbortController();
    $("send").disabled = true;
    $("stop").disabled = false;
    const started = performance.now();
    let first = null;
    let usage = null;
    let reply = "";
    const calls = [];
    try {
      const resp = await postJSON("/v1/chat/completions", body, this.controller.signal);
      for await (const data of sseData(resp)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.usage) usage = chunk.usage;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (!delta) continue;
        if (delta.content) {
          if (first === null) first = performance.now();
          reply += delta.content;
          out.textContent = reply;
        }
        for (const call of delta.tool_calls || []) {
          calls[call.index] = calls[call.index] || { id: "", name: "", arguments: "" };
          if (call.id) calls[call.index].id = call.id;
          if (call.function && call.function.name) calls[call.index].name += call.function.name;
          if (call.function && call.function.arguments) calls[call.index].arguments += call.function.arguments;
        }
      }
      const assistant = { role: "assistant", content: reply };
      if (calls.length) {
        out.textContent = reply + calls.map((c) => `\n→ ${c.name}(${c.arguments})`).join("");
        out.dataset.toolCalls = JSON.stringify(calls);
        assistant.tool_calls = calls.map((c) => ({
          id: c.id, type: "function", function: { name: c.name, arguments: c.arguments },
        }));
      }
      this.messages.push(assistant);
      this.showUsage(usage, started, first);
    } catch (err) {
      out.textContent = reply + (err.name === "AbortError" ? " [stopped]" : ` [error: ${err.message}]`);
      out.classList.add("error");
      this.messages.pop();
    } finally {
      out.classList.remove("streaming");
      this.controller = null;
      $("send").disabled = false;
      $("stop").disabled = true;
      this.onDone();
    }
  }

  showUsage(usage, started, first) {
    const el = $("usage");
    if (!usage) {
      el.textContent = "no usage reported";
      return;
    }
    const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    const total = (performance.now() - started) / 1000;
    const ttft = first === null ? null : (first - started) / 1000;
    el.dataset.cached = String(cached);
    el.dataset.prompt = String(usage.prompt_tokens);
    el.textContent =
      `prompt ${usage.prompt_tokens} tokens: ${cached} cached, ${usage.prompt_tokens - cached} computed · ` +
      `${usage.completion_tokens} generated · ` +
      (ttft === null ? "" : `TTFT ${(ttft * 1000).toFixed(0)} ms · `) +
      `${total.toFixed(2)} s, ${(usage.completion_tokens / Math.max(total, 1e-3)).toFixed(1)} tok/s`;
  }
}
