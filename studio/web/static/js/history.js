// The history sidebar: the studio's stored chats (/api/conversations), latest first. Search, new, rename,
// delete, export and import; the chat opens one, and the one last open comes back after a reload.

import { getJSON, postJSON, request } from "./api.js";
import { byId, debounce, el, fill } from "./dom.js";
import { plainError } from "./errors.js";

const CURRENT_KEY = "ggstudio-conversation";

export class HistoryPanel {
  constructor({ onOpen, onNew }) {
    this.onOpen = onOpen;
    this.onNew = onNew;
    this.list = byId("history-list");
    this.note = byId("history-note");
    this.search = byId("history-search");
    this.file = byId("history-file");
    this.current = localStorage.getItem(CURRENT_KEY);
    this.problem = null; // why the studio cannot keep history, from /api/status
    byId("history-new").addEventListener("click", () => this.onNew());
    this.search.addEventListener("input", debounce(() => this.refresh(), 250));
    byId("history-export").addEventListener("click", () => this.exportAll());
    byId("history-import").addEventListener("click", () => this.file.click());
    this.file.addEventListener("change", () => this.importFile());
  }

  /** Mark `id` as the open chat (null: a new one, not stored yet); a reload opens it again. */
  select(id) {
    this.current = id;
    if (id) localStorage.setItem(CURRENT_KEY, id);
    else localStorage.removeItem(CURRENT_KEY);
    this.mark();
  }

  /** What /api/status says about the store: a problem is shown until it is gone. */
  setStatus(history) {
    const problem = history && history.state === "unavailable" ? history.problem : null;
    if (problem === this.problem) return;
    this.problem = problem;
    if (problem) this.say(`Chats are not being saved. ${problem}`, true);
    else this.refresh();
  }

  async refresh() {
    const q = this.search.value.trim();
    try {
      const path = q ? `/api/conversations?q=${encodeURIComponent(q)}` : "/api/conversations";
      const { conversations } = await getJSON(path);
      fill(this.list, conversations.map((c) => this.item(c)));
      this.mark();
      this.say(q && !conversations.length ? "No chat matches." : "");
    } catch (err) {
      if (err.status !== 401) this.say(plainError(err), true);
    }
  }

  item(c) {
    const name = c.title || "New chat";
    const open = el("button.conv-open", { type: "button", text: name, title: `${name} · ${when(c.updated)}`,
                                          onclick: () => this.onOpen(c.id) });
    const li = el("li.conv", { dataset: { id: c.id } }, open);
    if (c.snippet) li.append(el("span.snippet", { text: c.snippet }));
    const remove = el("button.quiet.danger", { type: "button", text: "Delete", "aria-label": `Delete ${name}` });
    remove.addEventListener("click", () => this.remove(remove, c));
    li.append(el("div.conv-actions", {},
      el("button.quiet", { type: "button", text: "Rename", "aria-label": `Rename ${name}`,
                           onclick: () => this.rename(li, open, c) }),
      remove));
    return li;
  }

  mark() {
    for (const li of this.list.children) {
      const here = li.dataset.id === this.current;
      li.classList.toggle("current", here);
      li.querySelector(".conv-open")?.setAttribute("aria-current", String(here));
    }
  }

  /** Edit the title in place: Enter saves, Escape keeps the old one. */
  rename(li, open, c) {
    const input = el("input.conv-title", { value: c.title, "aria-label": "New name", maxlength: "1000" });
    open.replaceWith(input);
    input.focus();
    input.select();
    let done = false;
    const finish = async (save) => {
      if (done) return;
      done = true;
      if (save && input.value.trim() !== c.title) {
        try {
          await request("PATCH", `/api/conversations/${c.id}`, { title: input.value.trim() });
        } catch (err) {
          this.say(plainError(err), true);
        }
      }
      this.refresh();
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") finish(true);
      else if (e.key === "Escape") finish(false);
    });
    input.addEventListener("blur", () => finish(true));
  }

  /** Delete on a second click (the first asks), so one stray click loses nothing. */
  async remove(button, c) {
    if (button.dataset.sure !== "yes") {
      button.dataset.sure = "yes";
      button.textContent = "Delete?";
      setTimeout(() => { button.dataset.sure = ""; button.textContent = "Delete"; }, 4000);
      return;
    }
    try {
      await request("DELETE", `/api/conversations/${c.id}`);
      if (c.id === this.current) this.onNew();
    } catch (err) {
      this.say(plainError(err), true);
    }
    this.refresh();
  }

  async exportAll() {
    try {
      const blob = await (await request("GET", "/api/conversations/export")).blob();
      const url = URL.createObjectURL(blob);
      const link = el("a", { href: url, download: "gguf-studio-history.json", hidden: true });
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
      this.say("Exported every chat.");
    } catch (err) {
      this.say(plainError(err), true);
    }
  }

  async importFile() {
    const [file] = this.file.files;
    this.file.value = "";
    if (!file) return;
    let body;
    try {
      body = JSON.parse(await file.text());
    } catch (err) {
      this.say(`${file.name} is not a history export (not JSON: ${err.message}).`, true);
      return;
    }
    try {
      const { imported } = await postJSON("/api/conversations/import", body);
      this.say(`Imported ${imported.length} chat${imported.length === 1 ? "" : "s"} from ${file.name}.`);
    } catch (err) {
      this.say(`${file.name} was not imported. ${plainError(err)}`, true);
    }
    this.refresh();
  }

  say(text, isError = false) {
    this.note.textContent = text;
    this.note.classList.toggle("error", isError);
  }
}

function when(stamp) {
  const d = new Date(stamp);
  return Number.isNaN(d.getTime()) ? "" : d.toLocaleString();
}
