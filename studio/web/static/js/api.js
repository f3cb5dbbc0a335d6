// The studio's API as the page uses it: same-origin relative URLs only, JSON bodies declared as
// such (the studio refuses other body types from pages), the API token when the studio wants one,
// and server-sent events read from fetch streams (so a stream can carry the token and be aborted).

const TOKEN_KEY = "ggstudio-token";

/** An answer that was not 2xx, or no answer at all (status 0), with the studio's error fields. */
export class ApiError extends Error {
  constructor(status, error = {}) {
    super(error.message || `the studio answered ${status}`);
    this.status = status;
    this.type = error.type || null;
    this.code = error.code || null;
    this.param = error.param || null;
  }
}

let unauthorized = () => {};

/** Call `handler` whenever the studio answers 401 (it wants a token, or another one). */
export function onUnauthorized(handler) {
  unauthorized = handler;
}

export function setToken(token) {
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
}

export function hasToken() {
  return Boolean(sessionStorage.getItem(TOKEN_KEY));
}

/** fetch `path` on the studio; a body is sent as JSON. Throws ApiError unless the answer is 2xx. */
export async function request(method, path, body, { signal } = {}) {
  if (!path.startsWith("/")) throw new Error(`not a studio path: ${path}`);
  const headers = { Accept: "application/json, text/event-stream" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const init = { method, headers, signal, credentials: "same-origin", cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, { message: "cannot reach the studio; is `ggstudio serve` still running?",
                            code: "unreachable" });
  }
  if (!resp.ok) {
    const error = await errorOf(resp);
    if (resp.status === 401) unauthorized(error);
    throw new ApiError(resp.status, error);
  }
  return resp;
}

async function errorOf(resp) {
  try {
    const body = await resp.json();
    if (body && typeof body.error === "object") return body.error;
  } catch {
    // not JSON: fall through
  }
  return { message: `the studio answered ${resp.status} ${resp.statusText}`.trim() };
}

export async function getJSON(path, options) {
  return (await request("GET", path, undefined, options)).json();
}

/** POST a JSON body (always one, so the studio's JSON-only check sees its type). */
export async function postJSON(path, body = {}, options) {
  return (await request("POST", path, body, options)).json();
}

/** Yield each server-sent event's JSON `data` from a streaming response, until it ends. */
export async function* events(resp) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
        if (data.length) yield JSON.parse(data.join("\n"));
      }
    }
  } finally {
    reader.cancel().catch(() => {}); // a consumer that stops early closes the stream (the studio stops too)
  }
}

/** Open an event stream (GET, or POST with a JSON body) and yield its events. */
export async function* stream(method, path, body, options) {
  const resp = await request(method, path, body, options);
  yield* events(resp);
}
