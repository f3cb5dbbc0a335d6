// The load dialog: the settings of a load, with the planner's answer for them kept current.
// Each change asks /api/plan again (debounced; an older answer never overwrites a newer one):
// the predicted memory per device, the largest safe context (the slider's safe zone), the
// reasons, and the idle models the load would evict.

import { getJSON, postJSON } from "./api.js";
import { byId, debounce, el, fill } from "./dom.js";
import { bytes, count, parameters } from "./format.js";
import { plainError } from "./errors.js";

const STEP = 256;

export class LoadDialog {
  /** `onLoad(body)` starts the load with the dialog's settings. */
  constructor({ onLoad }) {
    this.onLoad = onLoad;
    this.dialog = byId("load-dialog");
    this.form = byId("load-form");
    this.ctx = byId("load-ctx");
    this.ctxNumber = byId("load-ctx-number");
    this.ctxValue = byId("load-ctx-value");
    this.safe = byId("load-ctx-safe");
    this.slots = byId("load-slots");
    this.cache = byId("load-cache");
    this.spec = byId("load-spec");
    this.draft = byId("load-draft");
    this.ttl = byId("load-ttl");
    this.pinned = byId("load-pinned");
    this.force = byId("load-force");
    this.submit = byId("load-submit");
    this.model = null;
    this.plan = null;
    this.asked = 0; // the number of the newest plan request
    this.touchedCtx = false;
    this.replan = debounce(() => this.ask(), 250);
    this.ctx.addEventListener("input", () => {
      this.touchedCtx = true;
      this.ctxNumber.value = this.ctx.value;
      this.showCtx();
      this.replan();
    });
    this.ctxNumber.addEventListener("change", () => {
      this.touchedCtx = true;
      const n = Math.max(STEP, Math.round(Number(this.ctxNumber.value) / STEP) * STEP || STEP);
      this.ctxNumber.value = String(n);
      if (n > Number(this.ctx.max)) this.ctx.max = String(n);
      this.ctx.value = String(n);
      this.showCtx();
      this.replan();
    });
    for (const input of [this.slots, this.cache, this.spec, this.draft]) {
      input.addEventListener("change", () => this.replan());
    }
    this.force.addEventListener("change", () => this.showFit());
    byId("load-cancel").addEventListener("click", () => this.dialog.close());
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.go();
    });
  }

  /** Fill the selects and bounds from what the studio accepts. */
  async init() {
    const options = await getJSON("/api/load-options");
    fill(this.cache, options.cache_types.map((t) => el("option", { value: t, text: t })));
    this.cache.value = "f16";
    fill(this.spec, options.spec_modes.map((m) => el("option", { value: m, text: m })));
    this.spec.value = "auto";
    this.slots.max = String(options.limits.n_parallel[1]);
    this.draft.max = String(options.limits.spec_n_max[1]);
    this.ctxLimit = options.limits.n_ctx[1];
  }

  open(model) {
    this.model = model;
    this.touchedCtx = false;
    this.plan = null;
    byId("load-title").textContent = `Load ${model.name}`;
    byId("load-facts").textContent = [model.architecture, model.parameters && `${parameters(model.parameters)} parameters`,
      model.quant, model.file_bytes && bytes(model.file_bytes),
      model.native_context && `native context ${count(model.native_context)}`].filter(Boolean).join(" · ");
    const native = model.native_context || 4096;
    this.ctx.max = String(Math.max(STEP, Math.ceil(native / STEP) * STEP));
    this.ctxNumber.max = String(this.ctxLimit || native);
    this.ctx.value = String(Math.min(native, 4096));
    this.ctxNumber.value = this.ctx.value;
    this.slots.value = "";
    this.draft.value = "";
    this.ttl.value = "";
    this.pinned.checked = false;
    this.force.checked = false;
    this.showCtx();
    fill(byId("load-bill"));
    fill(byId("load-reasons"));
    fill(byId("load-warnings"));
    this.setError(null);
    this.dialog.showModal();
    this.ctx.focus();
    this.ask();
  }

  /** The request the dialog stands for; the context only once the person moved it (else the plan picks). */
  body() {
    const body = { model: this.model.name, cache_type_kv: this.cache.value, spec: this.spec.value };
    if (this.touchedCtx) body.n_ctx = Number(this.ctx.value);
    if (this.slots.value !== "") body.n_parallel = Number(this.slots.value);  // else the planner's, by device
    if (this.draft.value !== "") body.spec_n_max = Number(this.draft.value);
    return body;
  }

  async ask() {
    if (!this.model || !this.dialog.open) return;
    const number = ++this.asked;
    byId("load-plan").setAttribute("aria-busy", "true");
    try {
      const plan = await postJSON("/api/plan", this.body());
      if (number !== this.asked) return; // a newer question is on its way
      this.plan = plan;
      this.setError(null);
      this.show(plan);
    } catch (err) {
      if (number !== this.asked) return;
      this.plan = null;
      this.setError(plainError(err));
      this.showFit();
    } finally {
      if (number === this.asked) byId("load-plan").setAttribute("aria-busy", "false");
    }
  }

  show(plan) {
    const ctx = plan.context;
    if (!this.touchedCtx) {
      this.ctx.value = String(ctx.n_ctx);
      this.ctxNumber.value = String(ctx.n_ctx);
    }
    this.maxSafe = ctx.max_safe;
    this.showCtx();
    fill(byId("load-bill"), plan.bill.map((d) => billRow(d)));
    fill(byId("load-reasons"), plan.reasons.map((r) => el("li", { text: r })));
    fill(byId("load-warnings"), plan.warnings.map((w) => el("li.warn", { text: w })));
    const evicts = byId("load-evicts");
    evicts.hidden = !plan.evicts.length;
    evicts.textContent = plan.evicts.length ? `Loading it unloads ${plan.evicts.join(", ")} (idle, least recently used).` : "";
    const blocked = byId("load-blocked");
    blocked.hidden = !plan.blocked_by.length;
    blocked.textContent = plan.blocked_by.length
      ? `Memory is held by models that cannot be unloaded now: ${plan.blocked_by.join(", ")}.` : "";
    this.showFit();
  }

  /** The slider's track shows the safe zone (up to the planner's largest safe context) in green. */
  showCtx() {
    const max = Number(this.ctx.max);
    const min = Number(this.ctx.min);
    const value = Number(this.ctx.value);
    this.ctxValue.textContent = `${count(value)} tokens`;
    if (this.maxSafe === undefined || this.maxSafe === null) {
      this.ctx.style.setProperty("--safe", "100%");
      this.safe.textContent = "";
      return;
    }
    const safe = max <= min ? 100 : Math.max(0, Math.min(100, (100 * (this.maxSafe - min)) / (max - min)));
    this.ctx.style.setProperty("--safe", `${safe}%`);
    const over = value > this.maxSafe;
    this.ctx.classList.toggle("over", over);
    this.safe.textContent = over
      ? `Above the largest safe context (${count(this.maxSafe)} tokens): it may not fit.`
      : `Largest safe context: ${count(this.maxSafe)} tokens.`;
    this.safe.classList.toggle("warn", over);
  }

  showFit() {
    const fits = Boolean(this.plan && this.plan.fits);
    byId("load-force-field").hidden = !this.plan || fits;
    this.submit.disabled = !this.plan || (!fits && !this.force.checked);
    this.submit.textContent = !this.plan || fits || this.force.checked ? "Load" : "Does not fit";
  }

  setError(text) {
    const node = byId("load-error");
    node.hidden = !text;
    node.textContent = text || "";
  }

  go() {
    if (this.submit.disabled) return;
    const body = this.body();
    if (!body.n_ctx && this.plan) body.n_ctx = this.plan.context.n_ctx;
    if (this.ttl.value !== "") body.ttl = Number(this.ttl.value);
    if (this.pinned.checked) body.pinned = true;
    if (this.force.checked) body.force = true;
    this.dialog.close();
    this.onLoad(body);
  }
}

function billRow(d) {
  const used = d.total_bytes;
  const budget = d.budget_bytes || used || 1;
  const parts = [["weights", d.weights_bytes], ["KV", d.kv_bytes], ["recurrent", d.recurrent_bytes],
    ["compute", d.compute_bytes], ["output", d.output_bytes]].filter(([, v]) => v > 0);
  const stack = el("div.stack", { role: "img",
    "aria-label": `${bytes(used)} of a ${bytes(d.budget_bytes)} budget: ${parts.map(([k, v]) => `${k} ${bytes(v)}`).join(", ")}` });
  for (const [kind, value] of parts) {
    const piece = el(`span.part.${kind.toLowerCase()}`, { title: `${kind} ${bytes(value)}` });
    piece.style.width = `${Math.min(100, (100 * value) / Math.max(budget, used))}%`;
    stack.append(piece);
  }
  return el(`li.device${d.fits ? "" : ".over"}`, {},
    el("div.dev-line", {},
      el("span.dev-name", { text: `${d.physical} ${d.name || ""}`.trim() }),
      el("span.mem-text", { text: `${bytes(used)} of ${bytes(d.budget_bytes)} budget${d.fits ? "" : " — over"}` })),
    stack,
    el("p.parts.note", { text: parts.map(([k, v]) => `${k} ${bytes(v)}`).join(" · ") }));
}
