// The chat: a conversation with one model through /api/chat, streamed as typed events.
// Stop aborts the fetch; the studio sees the client leave and stops llama-server's slot.
// Each chat is stored by the studio (/api/conversations) as it streams: `open` shows a stored one again
// and continues it with its model, load settings and options.

import { ApiError, getJSON, postJSON, request, stream } from "./api.js";
import { byId, el, fill } from "./dom.js";
import { count, percent } from "./format.js";
import { eventError, plainError } from "./errors.js";

const MAX_IMAGE_BYTES = 20 * 1024 * 1024;

const LOAD_FIELDS = ["n_ctx", "n_parallel", "cache_type_kv", "spec", "spec_n_max"];

export class Chat {
  constructor({ onConversation = () => {}, onStored = () => {} } = {}) {
    this.onConversation = onConversation; // a chat was created in the store, or opened: its id (null: none)
    this.onStored = onStored; // a turn was stored: titles and order in the sidebar may have changed
    this.conversation = null; // the stored conversation's id; null until the first message
    this.load = {}; // the stored conversation's load settings, used when its model is not resident
    this.history = []; // OpenAI messages sent so far (the system prompt is added per request)
    this.attachments = []; // {name, url} data URLs of images to send with the next message
    this.controller = null;
    this.models = new Map(); // name -> what the library and the status say about it
    this.library = []; // the library's models (/api/models)
    this.intro = null; // the base-model notice shown before the first message, for `introFor`
    this.introFor = null;
    this.chosen = null; // the model the person picked; null: follow the studio's default
    this.form = byId("chat-form");
    this.input = byId("chat-input");
    this.select = byId("chat-model");
    this.list = byId("messages");
    this.note = byId("chat-note");
    this.send = byId("send");
    this.stop = byId("stop");
    this.attach = byId("attach");
    this.files = byId("image-input");
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.submit();
    });
    this.input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.submit();
      }
    });
    this.stop.addEventListener("click", () => this.controller?.abort());
    this.select.addEventListener("change", () => this.choose(this.select.value));
    byId("chat-new").addEventListener("click", () => this.reset());
    this.opening = 0; // counts opens, so a slow one that was overtaken is dropped
    this.attach.addEventListener("click", () => this.files.click());
    this.files.addEventListener("change", () => this.addFiles([...this.files.files]));
  }

  /** Offer the tools the studio can run (`GET /api/tools`); a studio without them shows none. */
  async loadTools() {
    let tools;
    try {
      tools = (await getJSON("/api/tools")).tools || [];
    } catch (err) {
      if (err instanceof ApiError && err.status === 404) return;
      throw err;
    }
    if (!tools.length) return;
    const list = byId("opt-tool-list");
    fill(list, tools.map((t, i) => el("div.check", {},
      el("input", { type: "checkbox", id: `tool-${i}`, value: t.name, name: "tool" }),
      el("label", { for: `tool-${i}`, text: t.name, title: t.description || "" }))));
    byId("opt-tools").hidden = false;
  }

  /** The models one may chat with: resident ones first, then the library's (loaded on the first message). */
  setModels(status, library) {
    this.models = new Map();
    this.library = library;
    for (const m of library) this.models.set(m.name, { ...m, resident: null });
    for (const r of status.models || []) {
      this.models.set(r.model, { ...(this.models.get(r.model) || { name: r.model }), resident: r });
    }
    const resident = (status.models || []).map((r) => r.model);
    const others = library.map((m) => m.name).filter((n) => !resident.includes(n));
    const wanted = this.chosen ?? (status.model || resident[0] || "");
    const key = JSON.stringify([resident, others, wanted, (status.models || []).map((r) => r.state)]);
    if (key === this.lastKey) {
      this.showIntro(); // the library may have come after the status: what it says about the model counts
      return;
    }
    this.lastKey = key;
    const groups = [];
    if (resident.length) {
      groups.push(el("optgroup", { label: "Resident" }, (status.models || []).map((r) =>
        el("option", { value: r.model, text: r.state === "ready" ? r.model : `${r.model} (${r.state})` }))));
    }
    if (others.length) {
      groups.push(el("optgroup", { label: "Library (loads on the first message)" },
        others.map((n) => el("option", { value: n, text: n }))));
    }
    if (!groups.length) groups.push(el("option", { value: "", text: "no model yet" }));
    fill(this.select, groups);
    this.select.value = wanted;
    if (this.select.selectedIndex < 0 && this.select.options.length) this.select.selectedIndex = 0;
    this.updateAttach();
    this.showIntro();
  }

  /** Chat with `name` from now on (the model list, or the base-model notice's suggestion). */
  choose(name) {
    this.chosen = name || null;
    if (this.select.value !== name) this.select.value = name;
    this.updateAttach();
    this.showIntro();
  }

  /** Before the first message, a model that chats through llama-server's fallback template (a base model: no
   * template of its own, none configured) is named as such in the conversation, with what to use instead. */
  showIntro() {
    if (this.list.querySelector(".msg")) return; // the conversation has begun: the notice stays as it was
    const name = this.select.value;
    const base = name && isBase(this.models.get(name)) ? name : null;
    if (base === this.introFor && (!base || this.intro?.isConnected)) return;
    this.introFor = base;
    this.intro = base ? this.baseModelNote(base) : null;
    fill(this.list, this.intro);
  }

  baseModelNote(name) {
    const instructs = this.library.filter((m) => m.kind === "model" && m.chat_template); // a template of its own
    const instruct = instructs.find((m) => this.models.get(m.name)?.resident) || instructs[0];
    const other = instruct
      ? el("button.quiet", { type: "button", text: `Chat with ${instruct.name} instead`,
                             onclick: () => this.choose(instruct.name) })
      : null;
    return el("li.model-note", { role: "note", "aria-label": `${name} is a base model` },
      el("p", {}, el("strong", { text: `${name} is a base model.` }),
        " It has no chat template of its own, so this chat borrows one: llama-server's fallback template, ChatML. "
        + "A base model continues text rather than answering it, so its answers may ramble or repeat until they reach a turn marker or the token limit."),
      el("p", {}, "For a chat, pick an instruct model (one whose file carries a chat template); to continue a text "
        + "of your own, send it to ", el("code", { text: "/v1/completions" }), "."),
      other);
  }

  /** Images can be attached unless the model is known not to take them; the option fields show the model's
   * defaults in force (a resident's, else the library's: its config, its file's or llama-server's). */
  updateAttach() {
    const info = this.models.get(this.select.value);
    const defaults = info?.resident?.sampling || info?.sampling || {};
    for (const [id, key] of [["opt-temperature", "temperature"], ["opt-max-tokens", "max_tokens"]]) {
      const shown = defaults[key];
      const field = byId(id);
      field.placeholder = shown ? String(shown.value) : "default";
      field.title = shown ? `Empty: ${shown.value}, this model's default (from ${shown.source})` : "Empty: the default";
    }
    const blind = info && info.vision === false;
    this.attach.disabled = Boolean(blind);
    this.attach.title = blind ? `${info.name} does not take images (no vision projector)` : "Attach images";
  }

  async addFiles(files) {
    for (const file of files) {
      if (!file.type.startsWith("image/")) {
        this.say(`${file.name} is not an image.`);
        continue;
      }
      if (file.size > MAX_IMAGE_BYTES) {
        this.say(`${file.name} is larger than 20 MiB; pick a smaller image.`);
        continue;
      }
      const url = await new Promise((resolve, reject) => {
        const reader = new FileReader();
        reader.onload = () => resolve(reader.result);
        reader.onerror = () => reject(reader.error);
        reader.readAsDataURL(file);
      });
      this.attachments.push({ name: file.name, url });
    }
    this.files.value = "";
    this.renderAttachments();
  }

  renderAttachments() {
    fill(byId("attachments"), this.attachments.map((a, i) => el("li.thumb", {},
      el("img", { src: a.url, alt: a.name }),
      el("button.quiet", { type: "button", text: "Remove", "aria-label": `Remove ${a.name}`,
                           onclick: () => { this.attachments.splice(i, 1); this.renderAttachments(); } }))));
  }

  reset() {
    this.controller?.abort();
    this.opening += 1;
    this.conversation = null;
    this.load = {};
    this.history = [];
    fill(this.list);
    this.showIntro();
    this.say("");
    this.onConversation(null);
    this.input.focus();
  }

  /** Show the stored conversation `id` and continue it with its model and settings. */
  async open(id) {
    this.controller?.abort();
    const mine = ++this.opening;
    let c;
    try {
      c = await getJSON(`/api/conversations/${encodeURIComponent(id)}`);
    } catch (err) {
      if (mine !== this.opening) return;
      if (err.status === 404) this.reset();
      this.say(plainError(err));
      return;
    }
    const shown = [];
    const history = [];
    for (const m of c.messages) {
      if (m.role === "user") {
        const images = await storedImages(m.attachments || []);
        shown.push(userMessage(m.content, images));
        history.push({ role: "user", content: images.length
          ? [{ type: "text", text: m.content }, ...images.map((a) => ({ type: "image_url", image_url: { url: a.url } }))]
          : m.content });
      } else if (m.role === "assistant") {
        const view = AnswerView.stored(m, c.model || "the default model");
        shown.push(view.node);
        if (view.answer) history.push({ role: "assistant", content: view.answer });
      }
    }
    if (mine !== this.opening) return;
    this.conversation = c.id;
    this.load = c.load || {};
    this.history = history;
    fill(this.list, shown);
    this.setOptions(c.options || {});
    if (c.model) {
      this.chosen = c.model;
      this.lastKey = null; // the model list is drawn again with this chat's model chosen
      if ([...this.select.options].some((o) => o.value === c.model)) this.select.value = c.model;
    }
    this.showIntro(); // a stored chat with no message yet
    this.say("");
    this.onConversation(c.id);
    this.scroll(true);
  }

  setOptions(o) {
    byId("opt-system").value = o.system ?? "";
    byId("opt-temperature").value = o.temperature ?? "";
    byId("opt-max-tokens").value = o.max_tokens ?? "";
    byId("opt-reasoning").value = o.enable_thinking === undefined ? "" : o.enable_thinking ? "on" : "off";
    const tools = new Set(o.use_tools || []);
    for (const box of document.querySelectorAll("#opt-tool-list input")) box.checked = tools.has(box.value);
  }

  /** The stored conversation this turn goes to: created with the first message (null: the studio keeps none). */
  async stored(model) {
    if (this.conversation) return this.conversation;
    try {
      const system = byId("opt-system").value.trim();
      const options = { ...this.options(), ...(system ? { system } : {}) };
      const c = await postJSON("/api/conversations", { ...(model ? { model } : {}), options });
      this.conversation = c.id;
      this.onConversation(c.id);
      return c.id;
    } catch (err) {
      this.say(`This chat is not saved. ${plainError(err)}`);
      return null;
    }
  }

  /** Load this chat's model with its stored settings when it is in the library but not resident. */
  async ensureLoaded(model) {
    const info = model && this.models.get(model);
    const load = Object.fromEntries(LOAD_FIELDS.filter((k) => this.load[k] != null).map((k) => [k, this.load[k]]));
    if (!info || info.resident || !Object.keys(load).length) return;
    this.say(`Loading ${model} with this chat's settings…`);
    try {
      await postJSON("/api/load", { model, ...load });
    } catch (err) {
      this.say(`${model} did not load with this chat's settings. ${plainError(err)}`);
    }
  }

  say(text) {
    this.note.textContent = text;
  }

  options() {
    const out = {};
    const temperature = byId("opt-temperature").value;
    if (temperature !== "") out.temperature = Number(temperature);
    const maxTokens = byId("opt-max-tokens").value;
    if (maxTokens !== "") out.max_tokens = Number(maxTokens);
    const reasoning = byId("opt-reasoning").value;
    if (reasoning) out.enable_thinking = reasoning === "on";
    const tools = [...document.querySelectorAll("#opt-tool-list input:checked")].map((i) => i.value);
    if (tools.length) out.use_tools = tools;
    return out;
  }

  async submit() {
    if (this.controller) return;
    const text = this.input.value.trim();
    if (!text && !this.attachments.length) {
      this.say("Type a message first.");
      return;
    }
    const model = this.select.value || undefined;
    if (model && this.models.get(model)?.speech?.engine) {
      await this.speak(model, text);
      return;
    }
    const images = this.attachments;
    const content = images.length
      ? [{ type: "text", text }, ...images.map((a) => ({ type: "image_url", image_url: { url: a.url } }))]
      : text;
    this.history.push({ role: "user", content });
    this.list.append(userMessage(text, images));
    this.input.value = "";
    this.attachments = [];
    this.renderAttachments();
    const system = byId("opt-system").value.trim();
    const messages = system ? [{ role: "system", content: system }, ...this.history] : [...this.history];
    const view = new AnswerView(model || "the default model");
    this.list.append(view.node);
    this.scroll(true);
    const controller = new AbortController();
    this.controller = controller;
    this.busy(true);
    let failed = false;
    try {
      const conversation = await this.stored(model);
      await this.ensureLoaded(model);
      const body = { ...(model ? { model } : {}), messages, ...this.options(),
                     ...(conversation ? { conversation_id: conversation } : {}) };
      for await (const event of stream("POST", "/api/chat", body, { signal: controller.signal })) {
        if (event.type === "error") {
          failed = true;
          view.error(plainError(eventError(event), { chat: true }));
        } else if (event.type === "history") {
          view.unsaved(event.message);
        } else {
          view.handle(event);
        }
        this.scroll();
      }
      if (!failed && !view.finished) view.error("The answer broke off before it ended.");
    } catch (err) {
      if (err.name === "AbortError") view.stopped();
      else {
        failed = true;
        view.error(plainError(err, { chat: true }));
      }
    } finally {
      this.controller = null;
      this.busy(false);
      if (view.answer) {
        this.history.push({ role: "assistant", content: view.answer });
      } else if (failed) {
        this.history.pop(); // not answered: the next message replaces it
        if (!this.input.value) this.input.value = text;
      }
      this.say(view.summary());
      this.scroll();
      this.onStored();
    }
  }

  /** A text-to-speech model answers with audio (`/v1/audio/speech`): the answer gets a play button. The turn is
   * not a chat, so it is neither kept in the history sent to a model nor stored. */
  async speak(model, text) {
    this.list.append(userMessage(text, []));
    this.input.value = "";
    const view = new AnswerView(model);
    this.list.append(view.node);
    this.scroll(true);
    const controller = new AbortController();
    this.controller = controller;
    this.busy(true);
    try {
      const resp = await request("POST", "/v1/audio/speech", { model, input: text, voice: "alloy", response_format: "wav" },
                                 { signal: controller.signal });
      const wav = await resp.blob();
      view.audio(URL.createObjectURL(wav), (wav.size - 44) / 2 / 24000);
      this.say("");
    } catch (err) {
      if (err.name === "AbortError") view.stopped();
      else {
        view.error(plainError(err));
        if (!this.input.value) this.input.value = text;
      }
    } finally {
      this.controller = null;
      this.busy(false);
      this.scroll();
    }
  }

  busy(on) {
    this.send.disabled = on;
    this.stop.disabled = !on;
    this.list.setAttribute("aria-busy", String(on));
    if (on) this.stop.focus();
    else if (document.activeElement === this.stop || document.activeElement === document.body) this.input.focus();
  }

  scroll(force = false) {
    const near = this.list.scrollHeight - this.list.scrollTop - this.list.clientHeight < 80;
    if (force || near) this.list.scrollTop = this.list.scrollHeight;
  }
}

/** Whether `info` (a library entry, with its resident view once loaded) chats through the fallback template. */
function isBase(info) {
  if (!info) return false;
  const resident = info.resident?.capabilities?.fallback_template;
  return resident ?? Boolean(info.fallback_template);
}

/** A stored message's images as {name, url} with data URLs (shown, and sent again when the chat continues). */
async function storedImages(refs) {
  const out = [];
  for (const ref of refs) {
    try {
      const blob = await (await request("GET", `/api/attachments/${ref.hash}`)).blob();
      const url = await new Promise((resolve, reject) => {
        const reader = new FileReader();
        reader.onload = () => resolve(reader.result);
        reader.onerror = () => reject(reader.error);
        reader.readAsDataURL(blob);
      });
      out.push({ name: `image ${ref.hash.slice(0, 8)}`, url });
    } catch {
      // a missing file: the message still shows, without it
    }
  }
  return out;
}

function userMessage(text, images) {
  return el("li.msg.user", {},
    el("div.who", { text: "You" }),
    el("div.body", { text }),
    images.length ? el("ul.thumbs", {}, images.map((a) => el("li", {}, el("img", { src: a.url, alt: a.name }))))
      : null);
}

/** One answer as it streams: reasoning (collapsed), tool events, the text, then its numbers. */
class AnswerView {
  constructor(model) {
    this.answer = "";
    this.finished = false;
    this.outcome = "";
    this.reasoningText = document.createTextNode("");
    this.reasoning = el("details.reasoning", { hidden: true },
      el("summary", { text: "Reasoning" }), el("div.reasoning-text", {}, this.reasoningText));
    this.tools = el("ol.tool-events", { hidden: true, "aria-label": "Tools" });
    this.calls = new Map(); // tool_call deltas by index
    this.text = document.createTextNode("");
    this.body = el("div.body", {}, this.text);
    this.stats = el("p.stats");
    this.problem = el("p.error", { role: "alert", hidden: true });
    this.node = el("li.msg.assistant", { "aria-busy": "true" },
      el("div.who", { text: model }), this.reasoning, this.tools, this.body, this.stats, this.problem);
    this.body.classList.add("pending");
  }

  /** A stored answer as it was: text, reasoning, tool calls and results, its numbers, or "cut off". */
  static stored(m, model) {
    const view = new AnswerView(model);
    if (m.reasoning) view.handle({ type: "reasoning", text: m.reasoning });
    (m.tool_calls || []).forEach((call, i) => view.toolItem(`call-${i}`,
      `The model called ${call.name || "a tool"}(${clip(call.arguments || "", 300)})`, "call"));
    for (const result of m.tool_results || []) view.handle({ type: "tool_end", ...result });
    if (m.content) view.handle({ type: "content", text: m.content });
    if (m.cut) view.cutOff();
    else {
      const t = m.timings || {};
      view.done({ usage: m.usage || {}, timings: t, tokens_per_second: t.tokens_per_second,
                  finish_reason: t.finish_reason, draft_acceptance: t.draft_n ? t.draft_n_accepted / t.draft_n : null });
    }
    return view;
  }

  handle(event) {
    switch (event.type) {
      case "content":
        this.body.classList.remove("pending");
        this.answer += event.text;
        this.text.appendData(event.text);
        break;
      case "reasoning":
        this.reasoning.hidden = false;
        this.reasoningText.appendData(event.text);
        break;
      case "tool_call":
        this.toolCall(event);
        break;
      case "tool_start":
        this.toolItem(event.id || event.name, `Running ${event.name}(${clip(event.arguments || "", 200)})…`, "running");
        break;
      case "tool_end":
        this.toolItem(event.id || event.name, event.ok
          ? `${event.name} answered in ${(event.seconds ?? 0).toFixed(1)} s: ${clip(event.result || "", 400)}`
          : `${event.name} failed: ${clip(event.error || "", 400)}`, event.ok ? "ok" : "failed");
        break;
      case "status":
        this.toolItem(`status-${this.tools.children.length}`, event.message, "status");
        break;
      case "done":
        this.done(event);
        break;
      default:
        break; // an event this page does not know yet: ignored, the rest still shows
    }
  }

  toolCall(delta) {
    const key = delta.index ?? this.calls.size;
    const call = this.calls.get(key) || { name: "", arguments: "" };
    if (delta.function?.name) call.name += delta.function.name;
    if (delta.function?.arguments) call.arguments += delta.function.arguments;
    this.calls.set(key, call);
    this.toolItem(`call-${key}`, `The model calls ${call.name || "a tool"}(${clip(call.arguments, 300)})`, "call");
  }

  toolItem(key, text, kind) {
    this.tools.hidden = false;
    let item = this.tools.querySelector(`[data-key="${CSS.escape(String(key))}"]`);
    if (!item) {
      item = el("li", { dataset: { key: String(key) } });
      this.tools.append(item);
    }
    item.className = `tool ${kind}`;
    item.textContent = text;
  }

  done(event) {
    this.finished = true;
    this.node.setAttribute("aria-busy", "false");
    this.body.classList.remove("pending");
    const thought = this.reasoningText.data.trim();
    if (!this.answer && !this.calls.size && thought) {
      // It only reasoned: that is its answer, as the reference backend shows it (and the next turn reads it).
      this.answer = thought;
      this.text.data = thought;
      this.reasoning.hidden = true;
    } else if (!this.answer && !this.calls.size) this.body.textContent = "(no answer)";
    const parts = [];
    const usage = event.usage || {};
    if (usage.completion_tokens !== undefined) parts.push(`${count(usage.completion_tokens)} tokens`);
    if (event.tokens_per_second) parts.push(`${event.tokens_per_second.toFixed(1)} tokens/s`);
    if (event.draft_acceptance !== null && event.draft_acceptance !== undefined) {
      const t = event.timings || {};
      parts.push(`speculative acceptance ${percent(event.draft_acceptance)}` +
        (t.draft_n ? ` (${count(t.draft_n_accepted)} of ${count(t.draft_n)} drafted)` : ""));
    }
    if (event.finish_reason === "length") parts.push("stopped at the token limit");
    if (event.iterations > 1) parts.push(`${event.iterations} model calls`);
    this.stats.textContent = parts.join(" · ");
    this.outcome = `Answered: ${parts.join(", ")}.`;
  }

  cutOff() {
    this.node.setAttribute("aria-busy", "false");
    this.node.classList.add("cut");
    this.body.classList.remove("pending");
    if (!this.answer) this.body.textContent = "(no answer)";
    this.stats.textContent = "Cut off: this answer did not finish.";
  }

  unsaved(message) {
    this.problem.hidden = false;
    this.problem.textContent = `Not saved to the history: ${message}`;
  }

  /** The answer is speech: a play button and the player, and how long it lasts. */
  audio(url, seconds) {
    this.finished = true;
    this.node.setAttribute("aria-busy", "false");
    this.body.classList.remove("pending");
    const player = el("audio", { src: url, controls: true, preload: "auto" });
    const play = el("button.play", { type: "button", text: "Play", "aria-label": "Play the answer",
                                     onclick: () => {
                                       player.currentTime = 0;
                                       player.play().catch((err) => this.error(`The browser did not play it: ${err.message}`));
                                     } });
    fill(this.body, play, player);
    this.stats.textContent = `${seconds.toFixed(1)} s of speech`;
    this.outcome = this.stats.textContent;
  }

  stopped() {
    this.node.setAttribute("aria-busy", "false");
    this.body.classList.remove("pending");
    this.stats.textContent = "Stopped.";
    this.outcome = "Stopped.";
  }

  error(text) {
    this.node.setAttribute("aria-busy", "false");
    this.body.classList.remove("pending");
    this.problem.hidden = false;
    this.problem.textContent = text;
    this.outcome = text;
  }

  summary() {
    return this.outcome;
  }
}

function clip(text, n) {
  return text.length > n ? `${text.slice(0, n)}…` : text;
}
