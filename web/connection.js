// The WebSocket connection to /v1/ws (docs/protocol.md): reconnects with exponential backoff
// and jitter, offers the API key as the documented subprotocol, and reports its state.
//
// States: "connecting" (first try), "open" (session.created received), "waiting" (closed; the
// next try is scheduled at retryAt), "reconnecting" (a retry is in progress), "auth" (the
// server closed with 1008: a key is needed or was refused; no retry until a key is given).
//
// Events (EventTarget): "state" {state}, "message" {event}, "close" {code, reason, wasOpen}.

export const APP_SUBPROTOCOL = "quickdraft.v1";
export const KEY_SUBPROTOCOL_PREFIX = "quickdraft.api-key.";
const KEY_RE = /^[A-Za-z0-9._~!#$%&'*+^`|-]+$/; // what the server accepts as a key (a token)

export function isValidKey(key) {
  return typeof key === "string" && key.length >= 8 && KEY_RE.test(key);
}

/** Close codes of docs/protocol.md, in words. */
export function describeClose(code, reason) {
  const known = {
    1000: "The connection was closed",
    1006: "Connection lost",
    1007: "The server refused a message (invalid UTF-8)",
    1008: "The server needs a valid API key",
    1009: "A message was larger than the server accepts",
    1011: "Server error",
    1012: "The server is restarting",
    1013: "The server is busy or still loading the model",
  };
  const text = known[code] || `Connection closed (code ${code})`;
  return reason ? `${text}: ${reason}` : text;
}

export class Connection extends EventTarget {
  constructor(url, { getKey = () => null, baseDelayMs = 500, maxDelayMs = 10000 } = {}) {
    super();
    this.url = url;
    this.getKey = getKey;
    this.baseDelayMs = baseDelayMs;
    this.maxDelayMs = maxDelayMs;
    this.state = "idle";
    this.attempt = 0; // failed tries since the last open session
    this.retryAt = 0;
    this.lastClose = null; // {code, reason}
    this.everOpened = false;
    this.ws = null;
    this._timer = null;
  }

  get isOpen() {
    return this.state === "open" && this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  start() {
    this._open();
  }

  /** Try now (after a key was entered, or "Retry now"). */
  retryNow() {
    this._open();
  }

  /** Send one client event; false if there is no open session. */
  send(event) {
    if (!this.isOpen) return false;
    this.ws.send(JSON.stringify(event));
    return true;
  }

  _open() {
    clearTimeout(this._timer);
    this._timer = null;
    if (this.ws) {
      const old = this.ws;
      this.ws = null; // its close event is ignored
      try { old.close(1000); } catch { /* already closing */ }
    }
    const protocols = [APP_SUBPROTOCOL];
    const key = this.getKey();
    if (isValidKey(key)) protocols.push(KEY_SUBPROTOCOL_PREFIX + key);
    this._setState(this.everOpened || this.attempt > 0 ? "reconnecting" : "connecting");
    let ws;
    try {
      ws = new WebSocket(this.url, protocols);
    } catch (err) {
      this._closed({ code: 1006, reason: String(err.message || err) }, false);
      return;
    }
    this.ws = ws;
    ws.addEventListener("message", (e) => {
      if (this.ws !== ws || typeof e.data !== "string") return;
      let event;
      try {
        event = JSON.parse(e.data);
      } catch {
        return;
      }
      if (event && event.type === "session.created") {
        this.attempt = 0;
        this.everOpened = true;
        this.lastClose = null;
        this._setState("open");
      }
      this.dispatchEvent(new CustomEvent("message", { detail: { event } }));
    });
    ws.addEventListener("close", (e) => {
      if (this.ws !== ws) return;
      this.ws = null;
      this._closed({ code: e.code, reason: e.reason }, this.state === "open");
    });
  }

  _closed(info, wasOpen) {
    this.lastClose = info;
    this.dispatchEvent(new CustomEvent("close", { detail: { ...info, wasOpen } }));
    if (info.code === 1008) {
      this._setState("auth");
      return;
    }
    const exp = Math.min(this.maxDelayMs, this.baseDelayMs * 2 ** this.attempt);
    const delay = Math.round(exp * (0.8 + 0.4 * Math.random())); // jitter: no thundering herd
    this.attempt += 1;
    this.retryAt = Date.now() + delay;
    this._setState("waiting");
    this._timer = setTimeout(() => this._open(), delay);
  }

  _setState(state) {
    this.state = state;
    this.dispatchEvent(new CustomEvent("state", { detail: { state } }));
  }
}
