// The activity view: the studio's requests, loads and evictions on one time axis (plain SVG, one lane per
// model, a request's bar split into its phases), and the same records in a table below; live while open.

import { getJSON, request, stream } from "./api.js";
import { byId, el, fill } from "./dom.js";
import { plainError } from "./errors.js";

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 1000;
const LABEL = 120; // the lane names' column
const ROW = 12; // one request's bar
const GAP = 4;
const AXIS = 22;
const PHASES = ["queued", "load_wait", "prefill", "decode"];
const PHASE_NAMES = { queued: "queued", load_wait: "waiting for a load", prefill: "prefill", decode: "decode" };
const SHOWN = 300; // records drawn at most

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined) node.setAttribute(key, String(value));
  }
  for (const child of children) node.append(child);
  return node;
}

function titled(node, text) {
  node.append(svg("title", {}, text));
  return node;
}

function ms(s) {
  if (s === null || s === undefined) return "-";
  return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(1)} s`;
}

function clock(epoch) {
  return epoch ? new Date(epoch * 1000).toLocaleTimeString("en-GB") : "-";
}

function startOf(record) {
  return record.times.arrived ?? record.times.began;
}

function endOf(record, now) {
  return record.times.ended ?? now;
}

export class ActivityView {
  constructor() {
    this.dialog = byId("activity-dialog");
    this.chart = byId("activity-chart");
    this.body = byId("activity-table").tBodies[0];
    this.note = byId("activity-note");
    this.records = [];
    this.inFlight = [];
    this.controller = null;
    this.redrawing = null;
    byId("activity-open").addEventListener("click", () => this.open());
    byId("activity-close").addEventListener("click", () => this.dialog.close());
    byId("activity-delete").addEventListener("click", () => this.deleteAll());
    byId("activity-export").addEventListener("click", () => this.exportAll());
    this.dialog.addEventListener("close", () => this.controller?.abort());
  }

  async open() {
    this.controller?.abort();
    const controller = new AbortController();
    this.controller = controller;
    this.dialog.showModal();
    this.note.textContent = "Reading the activity…";
    try {
      const found = await getJSON(`/api/activity?limit=${SHOWN}`, { signal: controller.signal });
      this.records = found.records;
      this.inFlight = found.in_flight;
      this.note.textContent = found.records.length ? "" : "Nothing yet: send a request.";
      this.draw();
      for await (const event of stream("GET", "/api/activity/events", undefined, { signal: controller.signal })) {
        this.take(event);
      }
    } catch (err) {
      if (err.name !== "AbortError") this.note.textContent = plainError(err);
    }
  }

  take(event) {
    if (event.type === "in_flight") this.inFlight = event.requests;
    else if (event.type === "begin") this.inFlight = [...this.inFlight, event.request];
    else if (event.type === "record") {
      this.records = [event.record, ...this.records.filter((r) => r.id !== event.record.id)].slice(0, SHOWN);
      this.inFlight = this.inFlight.filter((r) => r.id !== event.record.id);
      this.note.textContent = "";
    }
    this.redrawing ??= requestAnimationFrame(() => {
      this.redrawing = null;
      this.draw();
    });
  }

  async deleteAll() {
    try {
      await request("DELETE", "/api/activity");
      this.records = [];
      this.draw();
      this.note.textContent = "Deleted.";
    } catch (err) {
      this.note.textContent = plainError(err);
    }
  }

  async exportAll() {
    try {
      const blob = await (await request("GET", "/api/activity/export")).blob();
      const link = el("a", { href: URL.createObjectURL(blob), download: "ggstudio-activity.jsonl" });
      link.click();
      setTimeout(() => URL.revokeObjectURL(link.href), 1000);
    } catch (err) {
      this.note.textContent = plainError(err);
    }
  }

  draw() {
    this.drawChart();
    this.drawTable();
  }

  /** Lanes per model: each request on the first row of its lane where it overlaps nothing. */
  drawChart() {
    const now = Date.now() / 1000;
    const live = this.inFlight.map((r) => ({ ...r, kind: "request", live: true, times: { arrived: r.arrived } }));
    const all = [...this.records, ...live];
    if (!all.length) {
      fill(this.chart);
      this.chart.setAttribute("viewBox", `0 0 ${WIDTH} 40`);
      return;
    }
    const t0 = Math.min(...all.map(startOf));
    const t1 = Math.max(...all.map((r) => endOf(r, now)), t0 + 1);
    const x = (t) => LABEL + ((t - t0) / (t1 - t0)) * (WIDTH - LABEL - 10);
    const lanes = new Map();
    const lane = (model) => {
      const name = model || "(no model)";
      if (!lanes.has(name)) lanes.set(name, { rows: [], items: [] });
      return lanes.get(name);
    };
    const chronological = [...all].sort((a, b) => startOf(a) - startOf(b));
    for (const r of chronological) {
      const l = lane(r.model);
      if (r.kind !== "request") {
        l.items.push({ r, row: -1 });
        continue;
      }
      const start = startOf(r);
      let row = l.rows.findIndex((end) => end <= start);
      if (row < 0) row = l.rows.push(0) - 1;
      l.rows[row] = endOf(r, now);
      l.items.push({ r, row });
    }
    const nodes = [];
    let y = AXIS;
    for (const [name, l] of [...lanes.entries()].sort((a, b) => a[0].localeCompare(b[0]))) {
      const height = 10 + Math.max(1, l.rows.length) * (ROW + GAP);
      const group = svg("g", { class: "lane-group", "data-model": name });
      group.append(svg("rect", { class: "lane", x: 0, y, width: WIDTH, height }));
      group.append(svg("text", { class: "lane-label", x: 6, y: y + 16 }, name));
      for (const { r, row } of l.items) {
        if (r.kind === "request") group.append(this.requestBar(r, x, y + 8 + row * (ROW + GAP), now));
        else group.append(this.residencyMark(r, x, y, height));
      }
      nodes.push(group);
      y += height + GAP;
    }
    const ticks = [];
    for (let i = 0; i <= 5; i++) {
      const t = t0 + ((t1 - t0) * i) / 5;
      ticks.push(svg("line", { class: "tick", x1: x(t), x2: x(t), y1: AXIS - 4, y2: y }));
      ticks.push(svg("text", { class: "tick-label", x: x(t), y: 14, "text-anchor": i === 5 ? "end" : "middle" },
        clock(t)));
    }
    this.chart.setAttribute("viewBox", `0 0 ${WIDTH} ${y}`);
    fill(this.chart, ticks, nodes);
  }

  requestBar(r, x, y, now) {
    const bar = svg("g", { class: `request${r.live ? " in-flight" : ""}`, "data-id": r.id, "data-outcome": r.outcome });
    const what = `${r.route} · ${r.outcome}${r.error ? `: ${r.error.message}` : ""}`;
    if (r.live) {
      const phase = r.phase === "loading" ? "load_wait" : r.phase;
      const rect = svg("rect", { class: `phase phase-${phase}`, "data-phase": phase, x: x(r.arrived), y,
        width: Math.max(2, x(now) - x(r.arrived)), height: ROW });
      bar.append(titled(rect, `${what} · ${PHASE_NAMES[phase] || phase} now, for ${ms(r.seconds)}`));
      return bar;
    }
    let at = r.times.arrived;
    for (const phase of PHASES) {
      const seconds = r.phases[phase] || 0;
      if (seconds <= 0) continue;
      const rect = svg("rect", { class: `phase phase-${phase}`, "data-phase": phase, x: x(at), y,
        width: Math.max(1.5, x(at + seconds) - x(at)), height: ROW });
      const load = phase === "load_wait" && r.load ? ` (the load of ${r.load.model}, ${r.load.id})` : "";
      bar.append(titled(rect, `${what} · ${PHASE_NAMES[phase]} ${ms(seconds)}${load}`));
      at += seconds;
    }
    if (r.outcome === "error") {
      bar.append(svg("rect", { class: "failed", x: x(r.times.arrived), y, fill: "none",
        width: Math.max(2, x(endOf(r, now)) - x(r.times.arrived)), height: ROW }));
    }
    return bar;
  }

  residencyMark(r, x, y, height) {
    const kind = r.kind === "load" ? "load" : r.kind === "eviction" ? "eviction" : "eviction";
    const left = x(r.times.began);
    const mark = svg("rect", { class: `residency ${kind}`, "data-id": r.id, "data-kind": r.kind, x: left, y: y + 2,
      width: Math.max(3, x(r.times.ended) - left), height: height - 4, opacity: 0.35 });
    const what = r.kind === "load"
      ? `load of ${r.model} ${ms(r.seconds)}${r.evicted?.length ? `, evicted ${r.evicted.join(", ")}` : ""}`
      : `${r.kind} of ${r.model} (${r.reason || r.event}) ${ms(r.seconds)}`;
    return titled(mark, what);
  }

  /** A captured request's bodies, under the table. */
  async showCapture(id) {
    const box = byId("activity-capture");
    try {
      const kept = await getJSON(`/api/activity/captures/${encodeURIComponent(id)}`);
      box.textContent = `request ${id} (${kept.size} bytes kept)\n\n${kept.request}\n\nanswer:\n${kept.answer}`;
      box.hidden = false;
      box.focus();
    } catch (err) {
      this.note.textContent = plainError(err);
    }
  }

  drawTable() {
    const rows = this.records.map((r) => {
      if (r.kind !== "request") {
        return el("tr", { dataset: { id: r.id, kind: r.kind } },
          el("td", { text: clock(r.times.ended) }), el("td", { text: r.kind }), el("td", { text: r.model }),
          el("td", { text: "-" }), el("td", { text: "-" }), el("td", { text: ms(r.seconds) }), el("td", { text: "-" }),
          el("td", { text: "-" }), el("td", { text: "-" }), el("td", { text: "-" }),
          el("td", { text: `${r.outcome}${r.evicted?.length ? `, evicted ${r.evicted.join(", ")}` : ""}` }),
          el("td", { text: "" }));
      }
      const t = r.tokens;
      const tokens = `${t.prompt_processed ?? 0} + ${t.prompt_cached ?? 0} cached` +
        `${t.restored ? ` (${t.restored} restored)` : ""} → ${t.generated ?? 0}` +
        `${t.drafted ? ` (${t.accepted}/${t.drafted} drafted)` : ""}`;
      const outcome = `${r.outcome}${r.retries ? ` after ${r.retries} retr${r.retries === 1 ? "y" : "ies"}` : ""}` +
        `${r.error ? `: ${r.error.message}` : ""}`;
      return el("tr", { dataset: { id: r.id, kind: "request" } },
        el("td", { text: clock(r.times.arrived) }), el("td", { text: "request" }), el("td", { text: r.model || "-" }),
        el("td", { text: r.route }), el("td", { text: ms(r.phases.queued) }), el("td", { text: ms(r.phases.load_wait) }),
        el("td", { text: ms(r.phases.prefill) }), el("td", { text: ms(r.phases.decode) }),
        el("td", { text: r.decode_tps ? r.decode_tps.toFixed(1) : "-" }), el("td", { text: tokens }),
        el(`td${r.outcome === "error" ? ".error" : ""}`, {}, outcome,
          r.captured ? el("button.quiet.capture", { type: "button", text: "body", onclick: () => this.showCapture(r.id),
                                                    "aria-label": `The captured bodies of request ${r.id}` }) : null),
        el("td", { text: r.client?.user_agent || "-" }));
    });
    fill(this.body, rows);
  }
}
