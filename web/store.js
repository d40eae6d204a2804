// Conversations and settings, kept in the browser (localStorage). Nothing here talks to the
// server: the server's session only mirrors the current conversation while a socket is open.
//
// quickdraft.chat.v1   {version: 1, currentId, conversations: [{id, title, titleAuto, system,
//                       created, updated, messages: [{id, role, text, status, stats, error}]}]}
// quickdraft.params.v1 {temperature?, top_p?, max_output_tokens?, speculation?: boolean}
//                      (only what the user changed; absent = the server's default)

const CHAT_KEY = "quickdraft.chat.v1";
const PARAMS_KEY = "quickdraft.params.v1";

/** A random id that also works outside secure contexts (crypto.randomUUID needs one). */
export function uid(prefix = "") {
  const bytes = crypto.getRandomValues(new Uint8Array(10));
  return prefix + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function readJSON(storage, key) {
  try {
    const raw = storage.getItem(key);
    return raw ? JSON.parse(raw) : null;
  } catch {
    return null;
  }
}

function cleanConversation(c) {
  if (!c || typeof c.id !== "string" || !Array.isArray(c.messages)) return null;
  return {
    id: c.id,
    title: typeof c.title === "string" && c.title ? c.title : "New chat",
    titleAuto: c.titleAuto !== false,
    system: typeof c.system === "string" ? c.system : "",
    created: Number(c.created) || Date.now(),
    updated: Number(c.updated) || Date.now(),
    messages: c.messages
      .filter((m) => m && (m.role === "user" || m.role === "assistant"))
      .map((m) => ({
        id: typeof m.id === "string" ? m.id : uid("m_"),
        role: m.role,
        text: typeof m.text === "string" ? m.text : "",
        // an answer that was streaming when the page went away did not finish
        status: m.status === "streaming" ? "interrupted" : (m.status || "completed"),
        stats: m.stats || null,
        error: m.error || null,
      })),
  };
}

export class Store {
  constructor(storage = window.localStorage) {
    this.storage = storage;
    this.onError = () => {};
    const data = readJSON(storage, CHAT_KEY);
    const list = data && Array.isArray(data.conversations) ? data.conversations : [];
    this.conversations = list.map(cleanConversation).filter(Boolean);
    this.currentId = data && data.currentId;
    if (!this.conversations.length) this.create();
    if (!this.get(this.currentId)) this.currentId = this.sorted()[0].id;
    const params = readJSON(storage, PARAMS_KEY);
    this.params = params && typeof params === "object" ? params : {};
  }

  get current() {
    return this.get(this.currentId);
  }

  get(id) {
    return this.conversations.find((c) => c.id === id) || null;
  }

  /** Most recently updated first. */
  sorted() {
    return [...this.conversations].sort((a, b) => b.updated - a.updated);
  }

  create({ system = "" } = {}) {
    const now = Date.now();
    const conv = { id: uid("c_"), title: "New chat", titleAuto: true, system, created: now,
                   updated: now, messages: [] };
    this.conversations.push(conv);
    this.currentId = conv.id;
    this.save();
    return conv;
  }

  select(id) {
    if (this.get(id)) {
      this.currentId = id;
      this.save();
    }
  }

  rename(id, title) {
    const conv = this.get(id);
    const clean = (title || "").trim().slice(0, 200);
    if (!conv || !clean) return;
    conv.title = clean;
    conv.titleAuto = false;
    this.save();
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (!this.conversations.length) this.create();
    if (!this.get(this.currentId)) this.currentId = this.sorted()[0].id;
    this.save();
  }

  touch(conv) {
    conv.updated = Date.now();
    if (conv.titleAuto) {
      const first = conv.messages.find((m) => m.role === "user" && m.text.trim());
      if (first) conv.title = first.text.trim().replace(/\s+/g, " ").slice(0, 60);
    }
  }

  save() {
    const data = { version: 1, currentId: this.currentId, conversations: this.conversations };
    try {
      this.storage.setItem(CHAT_KEY, JSON.stringify(data));
    } catch (err) {
      this.onError(`Could not save the conversations in this browser: ${err.message || err}`);
    }
  }

  setParam(name, value) {
    if (value === null || value === undefined) delete this.params[name];
    else this.params[name] = value;
    this.saveParams();
  }

  resetParams() {
    this.params = {};
    this.saveParams();
  }

  saveParams() {
    try {
      this.storage.setItem(PARAMS_KEY, JSON.stringify(this.params));
    } catch {
      // settings are a convenience; the chat works without them
    }
  }
}
