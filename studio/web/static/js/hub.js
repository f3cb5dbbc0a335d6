// Hub search: GGUF repos from Hugging Face, each variant with its fit on this machine (from its
// header alone: the studio's planner, its budget and the resident models it would evict), and a
// Download button on the variants that fit. Downloads go through the library's pull box.

import { getJSON } from "./api.js";
import { byId, el, fill } from "./dom.js";
import { bytes } from "./format.js";
import { plainError } from "./errors.js";

export class HubSearch {
  /** `onDownload(spec)` pulls `owner/repo:VARIANT` (the library's pull box shows its progress). */
  constructor({ onDownload }) {
    this.onDownload = onDownload;
    this.form = byId("hub-search-form");
    this.input = byId("hub-search-input");
    this.start = byId("hub-search-start");
    this.status = byId("hub-search-status");
    this.list = byId("hub-results");
    this.asked = 0;
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.run();
    });
  }

  say(text, isError = false) {
    this.status.textContent = text;
    this.status.classList.toggle("error", isError);
  }

  async run() {
    const q = this.input.value.trim();
    if (!q) {
      this.say("Type words of a repo name, e.g. gemma-3 or qwen3.", true);
      this.input.focus();
      return;
    }
    const asked = ++this.asked;
    this.start.disabled = true;
    this.say(`Searching Hugging Face for ${q} and reading each variant's header…`);
    try {
      const found = await getJSON(`/api/hub/search?${new URLSearchParams({ q, per_page: "5" })}`);
      if (asked !== this.asked) return;  // a newer search is on its way
      this.render(found);
      const n = found.repos.length;
      this.say(n ? `${n} ${n === 1 ? "repo" : "repos"}${found.more ? " (more on the Hub)" : ""}.`
               : `No GGUF repo matches ${q}.`);
    } catch (err) {
      if (asked === this.asked) this.say(plainError(err), true);
    } finally {
      if (asked === this.asked) this.start.disabled = false;
    }
  }

  render(found) {
    this.list.hidden = !found.repos.length;
    fill(this.list, found.repos.map((r) => this.repo(r)));
  }

  repo(r) {
    const id = `hub-${r.repo.replace(/[^A-Za-z0-9_-]/g, "_")}`;
    return el("li.card.hub-repo", { "aria-labelledby": `${id}-title`, dataset: { repo: r.repo } },
      el("h3", { id: `${id}-title`, text: r.repo }),
      r.recommendation ? el("p.note.recommendation", { text: r.recommendation }) : null,
      el("ul.variants", { "aria-label": `Variants of ${r.repo}` }, r.variants.map((v) => this.variant(v))));
  }

  variant(v) {
    const fit = v.fit || {};
    const fits = Boolean(fit.fits);
    const said = fit.error ? `cannot tell: ${fit.error}` : fit.badge || "";
    const size = `${bytes(v.size)}${v.shards > 1 ? `, ${v.shards} shards` : ""}`;
    const download = fits
      ? el("button", { type: "button", text: "Download", "aria-label": `Download ${v.model}` })
      : null;
    if (download) download.addEventListener("click", () => this.onDownload(v.model));
    return el("li.variant", { dataset: { model: v.model, fits: String(fits) } },
      el("div.variant-head", {},
        el("strong", { text: v.label }),
        v.recommended ? el("span.badge.recommended", { text: "recommended" }) : null,
        el("span.size", { text: size }),
        download),
      el(`span.badge.fit.${fits ? "fits" : "no-fit"}`, { text: said, title: said }));
  }
}
