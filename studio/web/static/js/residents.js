// The resident models: one card per model, updated in place from /api/status (so a TTL being
// typed or a focused button survives the next update).

import { postJSON } from "./api.js";
import { byId, el, fill } from "./dom.js";
import { bytes, count, seconds } from "./format.js";
import { plainError } from "./errors.js";

const COMING_UP = new Set(["loading", "crashed"]);

export class Residents {
  /** `onLog(model)` opens a model's log; `onChanged(status)` gets the status an action answered with. */
  constructor({ onLog, onChanged }) {
    this.onLog = onLog;
    this.onChanged = onChanged;
    this.cards = new Map();
    this.list = byId("resident-list");
    this.empty = byId("residents-empty");
    this.unloadAll = byId("unload-all");
    this.unloadAll.addEventListener("click", () => this.act(null, "/api/unload", {}, "Unloading every model…"));
  }

  update(status) {
    const models = status.models || [];
    const seen = new Set();
    for (const m of models) {
      seen.add(m.model);
      this.card(m.model).update(m, m.model === status.model);
    }
    for (const [name, card] of this.cards) {
      if (!seen.has(name)) {
        card.node.remove();
        this.cards.delete(name);
      }
    }
    this.empty.hidden = models.length > 0;
    this.unloadAll.hidden = models.length < 2;
  }

  card(model) {
    let card = this.cards.get(model);
    if (!card) {
      card = new Card(model, this);
      this.cards.set(model, card);
      this.list.append(card.node);
      this.empty.hidden = true;
    }
    return card;
  }

  /** Show a loading model's progress between status polls (a /api/progress event: its resident view). */
  progress(model, snapshot) {
    if (snapshot.model !== model || !snapshot.memory) return; // not resident yet
    const card = this.card(model);
    card.update(snapshot, card.isDefault);
  }

  async act(card, path, body, busyText) {
    if (card) card.say(busyText);
    try {
      const status = await postJSON(path, body);
      if (card) card.say("");
      this.onChanged(status);
    } catch (err) {
      if (card) card.say(plainError(err), true);
      else this.onChanged(null, plainError(err));
    }
  }
}

class Card {
  constructor(name, owner) {
    this.name = name;
    this.owner = owner;
    this.isDefault = false;
    const id = `resident-${name.replace(/[^A-Za-z0-9_-]/g, "_")}`;
    this.title = el("h3", { id: `${id}-title`, text: name });
    this.state = el("span.badge");
    this.defaultBadge = el("span.badge.default", { text: "default", title: "Requests that name no model go here" });
    this.facts = el("p.facts");
    this.progressBar = el("progress", { "aria-label": `Loading ${name}` });
    this.progressText = el("span.note");
    this.progressLine = el("div.progress-line", {}, this.progressBar, this.progressText);
    this.memory = el("ul.memory", { "aria-label": `Memory of ${name}, predicted and actual` });
    this.life = el("p.life");
    this.problem = el("p.error", { role: "alert", hidden: true });
    this.message = el("p.note", { role: "status" });
    this.pin = el("button", { type: "button", "aria-pressed": "false", text: "Pin",
                              title: "A pinned model is never evicted and never unloaded for idleness" });
    this.pin.addEventListener("click", () => {
      const pinned = this.pin.getAttribute("aria-pressed") !== "true";
      owner.act(this, "/api/pin", { model: name, pinned }, pinned ? "Pinning…" : "Unpinning…");
    });
    this.ttl = el("input", { type: "number", min: "0", step: "1", id: `${id}-ttl`, inputMode: "numeric" });
    const ttlForm = el("form.ttl", {},
      el("label", { for: `${id}-ttl`, text: "TTL (s)",
                  title: "Seconds idle before the model is unloaded; 0: never" }), this.ttl,
      el("button", { type: "submit", text: "Set" }));
    ttlForm.addEventListener("submit", (e) => {
      e.preventDefault();
      const ttl = Number(this.ttl.value);
      if (this.ttl.value === "" || !(ttl >= 0)) {
        this.say("Give the idle time in seconds (0: never unload for idleness).", true);
        return;
      }
      this.ttlDirty = false;
      owner.act(this, "/api/ttl", { model: name, ttl }, "Setting the TTL…");
    });
    this.ttl.addEventListener("input", () => { this.ttlDirty = true; });
    const log = el("button", { type: "button", text: "Log", "aria-label": `llama-server log of ${name}` });
    log.addEventListener("click", () => owner.onLog(name));
    this.unload = el("button.danger", { type: "button", text: "Unload", "aria-label": `Unload ${name}` });
    this.unload.addEventListener("click", () => owner.act(this, "/api/unload", { model: name }, "Unloading…"));
    this.node = el("li.card.resident", { "aria-labelledby": `${id}-title`, dataset: { model: name } },
      el("div.card-head", {}, this.title, this.state, this.defaultBadge),
      this.facts, this.progressLine, this.memory, this.life, this.problem,
      el("div.row.controls", {}, this.pin, ttlForm, el("span.spacer"), log, this.unload), this.message);
  }

  say(text, isError = false) {
    this.message.textContent = text;
    this.message.classList.toggle("error", isError);
  }

  update(m, isDefault) {
    this.isDefault = isDefault;
    this.state.textContent = m.state;
    this.state.className = `badge state-${m.state}`;
    this.defaultBadge.hidden = !isDefault;
    this.node.dataset.state = m.state;
    if (m.effective_context !== undefined) this.facts.textContent = facts(m);
    this.showProgress(m);
    if (m.memory) this.showMemory(m.memory);
    if (m.in_flight !== undefined) this.life.textContent = life(m);
    // a failure now, else the last death it was restarted after (killed by a signal, a crash)
    const died = !m.error && m.last_exit ? `Restarted after: ${m.last_exit}` : "";
    this.problem.hidden = !m.error && !died;
    this.problem.textContent = m.error ? `It failed: ${m.error}` : died;
    if (m.pinned !== undefined) {
      this.pin.setAttribute("aria-pressed", String(Boolean(m.pinned)));
      this.pin.textContent = m.pinned ? "Pinned" : "Pin";
    }
    if (m.ttl !== undefined && document.activeElement !== this.ttl && !this.ttlDirty) {
      this.ttl.value = m.ttl ?? "";
    }
  }

  showProgress(m) {
    const p = m.progress;
    const loading = COMING_UP.has(m.state);
    this.progressLine.hidden = !loading;
    if (!loading) return;
    if (p && p.bytes_total) {
      this.progressBar.max = p.bytes_total;
      this.progressBar.value = p.bytes_loaded || 0;
      this.progressText.textContent = `${p.phase}: ${bytes(p.bytes_loaded)} of ${bytes(p.bytes_total)}`;
    } else {
      this.progressBar.removeAttribute("value"); // indeterminate until the weights' size is known
      this.progressText.textContent = p ? p.phase : "starting llama-server";
    }
  }

  showMemory(memory) {
    const predicted = memory.predicted?.by_device || {};
    const actual = memory.actual?.by_device || {};
    const devices = [...new Set([...Object.keys(predicted), ...Object.keys(actual)])];
    fill(this.memory, devices.map((d) => {
      const p = predicted[d] ?? null;
      const a = actual[d] ?? null;
      const scale = Math.max(p || 0, a || 0, 1);
      return el("li.device", {},
        el("span.dev-name", { text: d }),
        el("div.bars", {},
          bar("predicted", p, scale, `predicted ${bytes(p)}`),
          bar("actual", a, scale, a === null ? "actual: known once loaded" : `actual ${bytes(a)}`)),
        el("span.mem-text", { text: `predicted ${bytes(p)} · actual ${a === null ? "–" : bytes(a)}` }));
    }));
  }
}

function bar(kind, value, scale, label) {
  const fillPart = el("span");
  fillPart.style.width = `${value === null ? 0 : Math.max(1, (100 * value) / scale)}%`;
  return el(`div.bar.${kind}`, { role: "img", "aria-label": label, title: label }, fillPart);
}

function facts(m) {
  const parts = [];
  if (m.effective_context) parts.push(`context ${count(m.effective_context)}` +
    (m.native_context ? ` of ${count(m.native_context)}` : ""));
  if (m.speculative) parts.push(`speculative ${m.speculative.resolved}`);
  if (m.cache_type_kv) parts.push(`KV ${m.cache_type_kv}`);
  if (m.offload) parts.push(m.offload.gpus && m.offload.gpus.length ? m.offload.gpus.join(", ") : "CPU");
  if (m.pid) parts.push(`pid ${m.pid}`);
  return parts.join(" · ");
}

function life(m) {
  const parts = [`${m.in_flight} request${m.in_flight === 1 ? "" : "s"} in flight`];
  if (m.state === "ready" && !m.in_flight) parts.push(`idle ${seconds(m.idle_s)}`);
  if (m.pinned) parts.push("pinned: stays loaded");
  else if (m.ttl_left !== null && m.ttl_left !== undefined) parts.push(`unloads in ${seconds(m.ttl_left)} if idle`);
  else if (!m.ttl) parts.push("no idle unload");
  if (m.restarts) parts.push(`${m.restarts} restart${m.restarts === 1 ? "" : "s"}`);
  return parts.join(" · ");
}
