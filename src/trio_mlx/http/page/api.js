// Talking to the server this page came from: requests with the API key, and error bodies.
//
// The key (`trio-mlx serve --api-key`) is kept in localStorage and sent as
// `Authorization: Bearer KEY`. A 401 asks for a key through `askKey(message)` (a promise of the
// key, or null when the user declines) and retries the request with it; a key the server accepts
// is kept, one it refuses is asked for again.

const KEY_STORAGE = "trio-mlx.api-key";

export class Api {
  /** `askKey(message)`: a Promise of a key, or of null when the user gives none. */
  constructor(askKey) {
    this.askKey = askKey;
    this.key = readStorage(KEY_STORAGE);
  }

  /** fetch(path, init) with the key; on 401 asks for a key and tries again. */
  async fetch(path, init = {}) {
    for (;;) {
      const headers = new Headers(init.headers || {});
      if (this.key) headers.set("Authorization", `Bearer ${this.key}`);
      const response = await fetch(path, { ...init, headers });
      if (response.status !== 401) {
        if (this.key) writeStorage(KEY_STORAGE, this.key);
        return response;
      }
      const refusal = await readError(response);
      const key = await this.askKey(
        this.key ? `The server refused this key: ${refusal.message}` : refusal.message,
      );
      if (!key) return refusalResponse(refusal);
      this.key = key;
    }
  }

  forgetKey() {
    this.key = null;
    removeStorage(KEY_STORAGE);
  }
}

/**
 * The error of a response that is not OK, read from its body: {status, message, type, code,
 * param}. Takes OpenAI's shape ({"error": {...}}), Anthropic's ({"type": "error", "error":
 * {...}}) and anything else (its text).
 */
export async function readError(response) {
  const text = await response.text().catch(() => "");
  let error = null;
  try {
    const body = JSON.parse(text);
    if (body && typeof body.error === "object" && body.error !== null) error = body.error;
    else if (body && typeof body.error === "string") error = { message: body.error };
  } catch {
    // not JSON: the text itself
  }
  return {
    status: response.status,
    message: (error && error.message) || text.trim() || response.statusText || "no details",
    type: (error && error.type) || null,
    code: (error && error.code) || null,
    param: (error && error.param) || null,
  };
}

/** One line for an error: "HTTP 400 (invalid_value, temperature): message". */
export function describeError(error) {
  const detail = [error.code || error.type, error.param].filter(Boolean).join(", ");
  const head = error.status ? `HTTP ${error.status}` : "Error";
  return `${head}${detail ? ` (${detail})` : ""}: ${error.message}`;
}

function refusalResponse(refusal) {
  return new Response(JSON.stringify({ error: refusal }), {
    status: 401,
    headers: { "Content-Type": "application/json" },
  });
}

function readStorage(name) {
  try {
    return window.localStorage.getItem(name);
  } catch {
    return null; // storage disabled
  }
}

function writeStorage(name, value) {
  try {
    window.localStorage.setItem(name, value);
  } catch {
    // storage disabled: the key lasts as long as the page
  }
}

function removeStorage(name) {
  try {
    window.localStorage.removeItem(name);
  } catch {
    // storage disabled
  }
}
