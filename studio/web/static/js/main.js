// The studio page: wires the library, the load dialog, the resident models, the chat, its history and
// the log viewer to the studio's API, and keeps them current from /api/status.

import { getJSON, hasToken, onUnauthorized, postJSON, setToken, stream } from "./api.js";
import { byId } from "./dom.js";
import { plainError } from "./errors.js";
import { Chat } from "./chat.js";
import { HistoryPanel } from "./history.js";
import { HubSearch } from "./hub.js";
import { Library } from "./library.js";
import { LoadDialog } from "./load.js";
import { LogViewer } from "./logs.js";
import { ActivityView } from "./activity.js";
import { Residents } from "./residents.js";

const POLL_MS = 1000;

const connection = byId("connection");
const noticeNode = byId("notice");
const logs = new LogViewer();
new ActivityView();
const chat = new Chat({
  onConversation: (id) => historyPanel.select(id),
  onStored: () => historyPanel.refresh(),
});
const historyPanel = new HistoryPanel({
  onOpen: (id) => chat.open(id),
  onNew: () => chat.reset(),
});
const residents = new Residents({
  onLog: (model) => logs.open(model),
  onChanged: (status, error) => {
    if (status) show(status);
    if (error) notice(error, true);
  },
});
const dialog = new LoadDialog({ onLoad: load });
const library = new Library({
  onLoad: (model) => dialog.open(model),
  onUnload: (name) => residents.act(residents.cards.get(name) || null, "/api/unload", { model: name }, "Unloading…"),
  onPulled: () => refreshLibrary(),
});
new HubSearch({ onDownload: (model) => library.pull.pullModel(model) });
let status = { models: [] };
let pollTimer = null;

function notice(text, isError = false) {
  noticeNode.textContent = text;
  noticeNode.title = text;
  noticeNode.classList.toggle("error", isError);
}

function show(next) {
  status = next;
  residents.update(status);
  library.setStatus(status);
  chat.setModels(status, library.models);
  historyPanel.setStatus(status.history);
  const n = (status.models || []).length;
  connection.textContent = `connected · ${n ? `${n} model${n === 1 ? "" : "s"} resident` : "no model loaded"}`;
  connection.classList.remove("error");
}

async function poll() {
  clearTimeout(pollTimer);
  try {
    show(await getJSON("/api/status"));
  } catch (err) {
    const text = err.status === 401 ? "waiting for the API token" : plainError(err);
    connection.textContent = text;
    connection.title = text;
    connection.classList.add("error");
    if (err.status === 401) return; // polled again once the token is given
  }
  pollTimer = setTimeout(poll, POLL_MS);
}

async function refreshLibrary() {
  try {
    await library.refresh();
    chat.setModels(status, library.models);
  } catch (err) {
    if (err.status !== 401) notice(plainError(err), true); // a 401 opens the token dialog instead
  }
}

/** Load with the dialog's settings; the model's card shows progress from /api/progress meanwhile. */
async function load(body) {
  notice(`Loading ${body.model}…`);
  const watching = new AbortController();
  watch(body.model, watching.signal);
  try {
    show(await postJSON("/api/load", body));
    notice(`${body.model} is ready.`);
  } catch (err) {
    notice(`${body.model} did not load. ${plainError(err)}`, true);
  } finally {
    watching.abort();
    poll();
  }
}

/** Follow a load's progress events until the load settles (a stream opened before the load is
 * registered ends at once: it is opened again until `signal` says the load is over). */
async function watch(model, signal) {
  const path = `/api/progress?model=${encodeURIComponent(model)}`;
  while (!signal.aborted) {
    try {
      for await (const snapshot of stream("GET", path, undefined, { signal })) residents.progress(model, snapshot);
    } catch (err) {
      if (err.name === "AbortError") return;
    }
    await new Promise((resolve) => setTimeout(resolve, 300));
  }
}

function setUpToken() {
  const tokenDialog = byId("token-dialog");
  const open = byId("token-open");
  const show = () => {
    open.hidden = false;
    if (!tokenDialog.open) {
      tokenDialog.showModal();
      byId("token-input").focus();
    }
  };
  onUnauthorized(show);
  open.hidden = !hasToken();
  open.addEventListener("click", show);
  byId("token-cancel").addEventListener("click", () => tokenDialog.close());
  byId("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    setToken(byId("token-input").value.trim());
    byId("token-input").value = "";
    tokenDialog.close();
    start();
  });
}

async function start() {
  const results = await Promise.allSettled([dialog.init(), refreshLibrary(), chat.loadTools()]);
  const failed = results.find((r) => r.status === "rejected" && r.reason.status !== 401);
  if (failed) notice(plainError(failed.reason), true);
  else notice("");
  poll();
  historyPanel.refresh();
  if (historyPanel.current) chat.open(historyPanel.current); // the chat open before a reload or a restart
}

setUpToken();
byId("library-refresh").addEventListener("click", () => refreshLibrary());
start();
