// A model's llama-server log, live: the last lines, then each new one as it is written.

import { stream } from "./api.js";
import { byId } from "./dom.js";
import { plainError } from "./errors.js";

const KEEP = 2000; // lines kept on screen

export class LogViewer {
  constructor() {
    this.dialog = byId("log-dialog");
    this.lines = byId("log-lines");
    this.follow = byId("log-follow");
    this.note = byId("log-note");
    this.controller = null;
    byId("log-close").addEventListener("click", () => this.dialog.close());
    this.dialog.addEventListener("close", () => this.controller?.abort());
    this.follow.addEventListener("change", () => this.scroll());
  }

  async open(model) {
    this.controller?.abort();
    const controller = new AbortController();
    this.controller = controller;
    byId("log-title").textContent = `llama-server log of ${model}`;
    this.lines.textContent = "";
    this.note.textContent = "Reading the log…";
    this.dialog.showModal();
    this.lines.focus();
    const path = `/api/logs?model=${encodeURIComponent(model)}&follow=true`;
    let n = 0;
    try {
      for await (const event of stream("GET", path, undefined, { signal: controller.signal })) {
        this.lines.append(`${event.line}\n`);
        if (++n > KEEP) this.lines.firstChild.remove();
        this.note.textContent = "";
        this.scroll();
      }
      this.note.textContent = n ? "The log ended: llama-server stopped." : "No log yet.";
    } catch (err) {
      if (err.name !== "AbortError") this.note.textContent = plainError(err);
    }
  }

  scroll() {
    if (this.follow.checked) this.lines.scrollTop = this.lines.scrollHeight;
  }
}
