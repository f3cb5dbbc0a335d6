// Errors in plain words: what happened, from the studio's own message, and what to do.

import { ApiError } from "./api.js";

const LEADS = {
  0: "The studio cannot be reached.",
  400: "The studio refused the request.",
  401: "The studio needs its API token.",
  403: "The studio refused this page.",
  404: "Not found.",
  409: "The load was cancelled.",
  413: "That is too large to send.",
  415: "The studio refused the request's body type.",
  429: "Too many requests at once.",
  499: "Cancelled.",
  500: "Something failed inside the studio.",
  502: "llama-server failed or stopped answering.",
  503: "The model is busy or going away; try again in a moment.",
  504: "The studio gave up waiting.",
  507: "There is not enough disk space.",
};

// In a chat most failures are llama-server's answer to the request, not the studio's.
const CHAT_LEADS = {
  400: "The model refused the request.",
  500: "The model could not answer.",
};

/** One sentence or two for a person: a lead for the kind of failure, then the studio's own words. */
export function plainError(err, { chat = false } = {}) {
  if (err && err.name === "AbortError") return "Stopped.";
  if (!(err instanceof ApiError)) return `Something went wrong in the page: ${err && err.message ? err.message : err}`;
  if (err.type === "exceed_context_size_error" || err.code === "exceed_context_size_error") {
    return `The conversation no longer fits the model's context: ${err.message}. Start a new chat, or load the ` +
      "model with a larger context.";
  }
  const lead = (chat && CHAT_LEADS[err.status]) || LEADS[err.status] || `The studio answered ${err.status}.`;
  const message = (err.message || "").trim();
  return message && err.status !== 0 ? `${lead} ${capitalise(message)}${/[.!?]$/.test(message) ? "" : "."}`
    : `${lead} ${err.status === 0 ? "Is `ggstudio serve` still running?" : ""}`.trim();
}

/** An `error` event of /api/chat as an ApiError (its `error` field has the studio's error shape). */
export function eventError(event) {
  const error = event.error && typeof event.error === "object" ? event.error : { message: event.message };
  return new ApiError(event.status || 500, error);
}

function capitalise(text) {
  return text.charAt(0).toUpperCase() + text.slice(1);
}
