// The library: every model the studio can serve (its folders and the Hugging Face cache) with
// the facts that matter when choosing one, and the pull box for Hugging Face downloads.

import { ApiError, getJSON, request, stream } from "./api.js";
import { byId, el, fill } from "./dom.js";
import { bytes, count, parameters, seconds } from "./format.js";
import { plainError } from "./errors.js";

/** How the library shows a model that is resident, by its state (one not listed is offered to load). */
const RESIDENT = {
  ready: { badge: "Loaded", action: "unload" },
  draining: { badge: "Unloading…", action: "unload" },
  loading: { badge: "Loading…", action: "unload" },
  crashed: { badge: "Restarting…", action: "unload" },
  unloading: { badge: "Unloading…", action: "busy" },
};

export class Library {
  /** `onLoad(model)` opens the load dialog; `onUnload(name)` unloads a resident model; `onPulled()` runs after a
   * download finished. */
  constructor({ onLoad, onUnload, onPulled }) {
    this.onLoad = onLoad;
    this.onUnload = onUnload;
    this.onPulled = onPulled;
    this.models = [];
    this.states = new Map(); // model name -> its resident chat instance's state
    this.cards = new Map(); // model name -> its card's badge and button
    this.list = byId("model-list");
    this.pull = new PullBox(() => this.onPulled());
  }

  async refresh() {
    this.models = await getJSON("/api/models");
    this.render();
    return this.models;
  }

  find(name) {
    return this.models.find((m) => m.name === name);
  }

  render() {
    this.cards = new Map();
    if (!this.models.length) {
      fill(this.list, el("li.note", { text: "No models yet: put .gguf files in the models folder, or pull one." }));
      return;
    }
    fill(this.list, this.models.map((m) => this.item(m)));
  }

  /** Follow /api/status: a resident model's card says so and offers Unload instead of Load…, updated in place. */
  setStatus(status) {
    this.states = new Map((status.models || []).filter((r) => r.instance !== "embeddings")
      .map((r) => [r.model, r.state]));
    for (const [name, card] of this.cards) this.show(name, card);
  }

  item(m) {
    const id = `model-${m.name.replace(/[^A-Za-z0-9_-]/g, "_")}`;
    const card = {
      model: m,
      badge: el("span.badge", { hidden: true }),
      button: el("button", { type: "button" }),
    };
    card.button.addEventListener("click", () => {
      if (card.action === "unload") this.onUnload(m.name);
      else this.onLoad(m);
    });
    this.cards.set(m.name, card);
    this.show(m.name, card);
    return el("li.card.model", { "aria-labelledby": `${id}-title`, dataset: { model: m.name } },
      el("div.card-head", {}, el("h3", { id: `${id}-title`, text: m.name, title: m.path }), card.badge, card.button),
      m.error ? el("p.error", { text: `Cannot be read: ${m.error}` }) : el("p.facts", { text: facts(m) }),
      m.error ? null : el("ul.chips", { "aria-label": "Capabilities" }, chips(m).map((c) => el("li.chip", { text: c }))));
  }

  /** Draw `card` as its model's resident state says: Load… when not resident (or failed), else its state and Unload. */
  show(name, card) {
    const state = this.states.get(name);
    const resident = RESIDENT[state];
    const action = resident ? resident.action : "load";
    if (card.action === action && card.state === state) return; // unchanged: the button keeps its focus
    card.action = action;
    card.state = state;
    card.badge.hidden = !state;
    card.badge.textContent = resident ? resident.badge : state || "";
    card.badge.className = `badge state-${state}`;
    card.button.className = action === "load" ? "primary" : "danger";
    card.button.textContent = action === "load" ? "Load…" : "Unload";
    card.button.setAttribute("aria-label", action === "load" ? `Load ${name}…` : `Unload ${name}`);
    card.button.disabled = action === "busy" || Boolean(card.model.error) || card.model.kind === "projector";
  }
}

function facts(m) {
  const parts = [m.architecture];
  if (m.parameters) parts.push(`${parameters(m.parameters)} parameters`);
  if (m.quant) parts.push(m.quant);
  if (m.file_bytes) parts.push(bytes(m.file_bytes));
  if (m.native_context) parts.push(`native context ${count(m.native_context)}`);
  return parts.filter(Boolean).join(" · ");
}

function chips(m) {
  const out = [];
  const t = m.chat_template;
  if (!t) out.push(m.fallback_template ? "base model: no chat template" : "chat template from the config");
  if (t && t.supports_reasoning) out.push(t.always_thinks ? "reasoning (always)" : "reasoning");
  if (t && t.supports_tools) out.push("tools");
  if (m.vision) out.push("vision");
  if (m.audio) out.push("audio");
  if (m.tts) out.push("text to speech");
  if (m.experts) out.push(`MoE ${m.experts_used}/${m.experts}`);
  if (m.mtp_layers) out.push("MTP");
  if (m.swa_layers) out.push("sliding window");
  if (m.recurrent_layers) out.push("recurrent");
  if (m.path && m.path.includes("/huggingface/")) out.push("HF cache");
  return out;
}

/** `POST /api/pull {model}` with progress events; cancel is `DELETE /api/pulls/{id}`. */
class PullBox {
  constructor(onDone) {
    this.onDone = onDone;
    this.form = byId("pull-form");
    this.input = byId("pull-input");
    this.start = byId("pull-start");
    this.cancel = byId("pull-cancel");
    this.bar = byId("pull-progress");
    this.status = byId("pull-status");
    this.id = null;
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.run();
    });
    this.cancel.addEventListener("click", () => this.stop());
  }

  say(text, isError = false) {
    this.status.textContent = text;
    this.status.classList.toggle("error", isError);
  }

  /** Pull `model` (a search result's Download button): shown in the box as if typed there. */
  pullModel(model) {
    this.input.value = model;
    this.input.scrollIntoView({ block: "nearest" });
    return this.run();
  }

  async run() {
    const model = this.input.value.trim();
    if (!/^[^\s/]+\/[^\s/:]+(:\S+)?$/.test(model)) {
      this.say("Name a Hugging Face repo as owner/repo, with :QUANT to pick a file (e.g. :Q4_K_M).", true);
      this.input.focus();
      return;
    }
    this.start.disabled = true;
    this.bar.hidden = false;
    this.bar.removeAttribute("value");
    this.say(`Asking Hugging Face for ${model}…`);
    try {
      for await (const event of stream("POST", "/api/pull", { model })) {
        this.id = event.id || this.id;
        this.cancel.hidden = !this.id;
        if (event.type === "progress") this.progress(event);
        else if (event.type === "done") {
          this.bar.max = 1;
          this.bar.value = 1;
          this.say(`${model} is in the library${event.path ? ` (${event.path})` : ""}.`);
          this.onDone();
        } else if (event.type === "cancelled") this.say("The download was cancelled; finished files stay cached.");
        else if (event.type === "error") this.say(`The download failed: ${event.error || "no reason given"}`, true);
      }
    } catch (err) {
      if (err instanceof ApiError && err.status === 404 && /route/.test(err.message)) {
        this.say("This studio cannot pull from Hugging Face (it has no /api/pull).", true);
      } else {
        this.say(plainError(err), true);
      }
    } finally {
      this.start.disabled = false;
      this.cancel.hidden = true;
      this.id = null;
      if (this.bar.value !== 1) this.bar.hidden = true;
    }
  }

  progress(p) {
    if (p.total_bytes) {
      this.bar.max = p.total_bytes;
      this.bar.value = p.done_bytes || 0;
    }
    const parts = [`${bytes(p.done_bytes)} of ${bytes(p.total_bytes)}`];
    if (p.rate_bytes_per_s) parts.push(`${bytes(p.rate_bytes_per_s)}/s`);
    if (p.eta_s !== null && p.eta_s !== undefined) parts.push(`${seconds(p.eta_s)} left`);
    if (p.variant) parts.unshift(p.variant);
    this.say(parts.join(" · "));
  }

  async stop() {
    if (!this.id) return;
    try {
      await request("DELETE", `/api/pulls/${encodeURIComponent(this.id)}`);
      this.say("Cancelling…");
    } catch (err) {
      this.say(plainError(err), true);
    }
  }
}
