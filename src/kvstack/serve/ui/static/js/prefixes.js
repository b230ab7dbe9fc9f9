// The hottest cached prefixes as a tree (GET /v1/kv/prefixes), with a pin / unpin
// button per node: the prefix up to a node is its ancestors' token ids, then its own.

import { postJSON, request } from "./api.js";

function kib(bytes) {
  return bytes >= 1 << 20 ? `${(bytes / (1 << 20)).toFixed(1)} MiB` : `${(bytes / 1024).toFixed(1)} KiB`;
}

export class PrefixTree {
  constructor(list, info, notify) {
    this.list = list;
    this.info = info;
    this.notify = notify;
    this.busy = false;
  }

  async refresh() {
    if (this.busy) return;
    this.busy = true;
    try {
      const resp = await request("/v1/kv/prefixes?limit=40");
      this.render(await resp.json());
    } finally {
      this.busy = false;
    }
  }

  prefixIds(nodes, node) {
    const chain = [];
    for (let n = node; n; n = n.parent >= 0 ? nodes[n.parent] : null) chain.push(n.ids);
    return chain.reverse().flat();
  }

  async toggle(nodes, node, button) {
    button.disabled = true;
    const path = node.pinned ? "/v1/cache/unpin" : "/v1/cache/pin";
    try {
      const resp = await postJSON(path, { prompt: this.prefixIds(nodes, node) });
      const body = await resp.json();
      this.notify(node.pinned ? `unpinned ${node.end} tokens` : `pinned ${body.pinned_tokens} tokens`);
    } catch (err) {
      this.notify(`${node.pinned ? "unpin" : "pin"} failed: ${err.message}`);
    }
    await this.refresh();
  }

  render(tree) {
    this.info.textContent = `${tree.prefix_cache} cache · from the last ${tree.num_requests} prompts`;
    const items = new Map();
    const roots = [];
    for (const node of tree.nodes) {
      const li = document.createElement("li");
      li.dataset.tokens = String(node.end);
      li.dataset.pinned = String(node.pinned);
      const text = document.createElement("span");
      text.className = "ptext";
      text.textContent = JSON.stringify(node.text).slice(1, -1) || "(no text)";
      const meta = document.createElement("small");
      meta.textContent =
        ` tokens ${node.start}–${node.end} · ${kib(node.bytes)} · ${node.hits} hits / ${node.requests} prompts`;
      const button = document.createElement("button");
      button.type = "button";
      button.className = node.pinned ? "unpin" : "pin";
      button.textContent = node.pinned ? "unpin" : "pin";
      button.addEventListener("click", () => this.toggle(tree.nodes, node, button));
      const ul = document.createElement("ul");
      li.append(button, text, meta, ul);
      items.set(node.id, ul);
      if (node.parent >= 0 && items.has(node.parent)) items.get(node.parent).append(li);
      else roots.push(li);
    }
    if (!roots.length) {
      const li = document.createElement("li");
      li.className = "empty";
      li.textContent = "no cached prefix among the recent prompts yet";
      roots.push(li);
    }
    this.list.replaceChildren(...roots);
  }
}
