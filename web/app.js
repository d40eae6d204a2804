// quickdraft chat: a browser client of the WebSocket protocol in docs/protocol.md, and nothing
// else (no HTTP API calls). Conversations live in localStorage; the server's session holds a
// mirror of the current one: before each response.create the page deletes/creates items so
// the server's conversation equals the local one, and answers use conversation: "none" (the
// page adds them itself), so local and server state never drift apart.

import { copyText, renderMarkdown, sanitize } from "./markdown.js";
import { Connection, describeClose, isValidKey } from "./connection.js";
import { Store, uid } from "./store.js";

const KEY_STORAGE = "quickdraft.apiKey";
const THEME_STORAGE = "quickdraft.theme";
const RENDER_INTERVAL_MS = 50; // streamed text is re-rendered at most this often
const SAVE_INTERVAL_MS = 1000; // and saved to localStorage at most this often while streaming
const TOAST_MS = 12000;

const $ = (id) => document.getElementById(id);
const el = {
  app: $("app"), sidebar: $("sidebar"), scrim: $("scrim"), convList: $("conversation-list"),
  newChat: $("new-chat"), toggleSidebar: $("toggle-sidebar"), title: $("chat-title"),
  model: $("model-name"), status: $("conn-status"), toggleSettings: $("toggle-settings"),
  themeToggle: $("theme-toggle"), banner: $("banner"), bannerText: $("banner-text"),
  bannerAction: $("banner-action"), settings: $("settings"), system: $("system-prompt"),
  temperature: $("p-temperature"), topP: $("p-top-p"), maxTokens: $("p-max-tokens"),
  speculation: $("p-speculation"), resetParams: $("reset-params"), forgetKey: $("forget-key"),
  messages: $("messages"), toasts: $("toasts"), composer: $("composer"), input: $("input"),
  send: $("send"), stop: $("stop"), keyDialog: $("key-dialog"), keyForm: $("key-form"),
  keyInput: $("api-key-input"), keyText: $("key-dialog-text"), keyError: $("key-dialog-error"),
  keyCancel: $("key-cancel"),
};
el.statusText = el.status.querySelector(".conn-text");

const store = new Store();
store.onError = (message) => toast(message);

let session = null; // the session object of session.created
let mirror = []; // the server session's conversation: [{id, role, text}]
const syncOps = new Map(); // event_id -> {op, id} of our item create/delete events
const runs = new Map(); // event_id of response.create -> run (one answer being streamed)
const byResponse = new Map(); // response id -> run
const msgNodes = new Map(); // message id -> {node, body, meta} in the current conversation
let editingId = null; // the user message being edited
let renamingId = null; // the conversation being renamed
let bannerTimer = null;

// ---------------------------------------------------------------------------- connection

const pageParams = new URLSearchParams(location.search);
const wsUrl = (() => {
  const url = new URL("v1/ws", location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  url.search = "";
  url.hash = "";
  return url.href;
})();
const maxDelay = Number(pageParams.get("reconnect_max_ms")) || 10000;

function storedKey() {
  try {
    return localStorage.getItem(KEY_STORAGE);
  } catch {
    return null;
  }
}

const conn = new Connection(wsUrl, { getKey: storedKey, maxDelayMs: maxDelay });
conn.addEventListener("state", renderConnection);
conn.addEventListener("message", (e) => onServerEvent(e.detail.event));
conn.addEventListener("close", (e) => onClose(e.detail));

function onServerEvent(ev) {
  switch (ev.type) {
    case "session.created":
      session = ev.session;
      mirror = [];
      syncOps.clear();
      interruptRuns("The connection was replaced; the answer was cut off.", null);
      el.model.textContent = session.model || "";
      renderParams();
      if (!store.current.messages.length) renderMessages(); // the welcome names the model
      break;
    case "conversation.item.created":
    case "conversation.item.deleted":
      syncOps.delete(ev.client_event_id);
      break;
    case "response.created": {
      const run = runs.get(ev.client_event_id);
      if (!run) return;
      run.responseId = ev.response.id;
      byResponse.set(run.responseId, run);
      if (run.cancelRequested) sendCancel(run);
      break;
    }
    case "response.output_text.delta":
      onDelta(ev);
      break;
    case "response.done":
      onDone(ev.response, ev.client_event_id);
      break;
    case "error":
      onError(ev);
      break;
    default:
      break; // session.updated etc.: nothing to do
  }
}

/** Answers of a socket that is gone: they will get no more events. */
function interruptRuns(message, code) {
  for (const run of [...runs.values()]) {
    run.msg.status = "interrupted";
    run.msg.error = { message, code };
    endRun(run);
  }
}

function onClose({ code, reason }) {
  mirror = [];
  syncOps.clear();
  interruptRuns(`${describeClose(code, reason)}; the answer was cut off.`, `close ${code}`);
  if (code === 1008) {
    openKeyDialog(storedKey() ? "The server refused the stored API key. Enter another one."
                              : "This server asks for an API key.");
  }
}

function renderConnection() {
  const state = conn.state;
  el.status.dataset.state = state;
  el.statusText.textContent = {
    idle: "Offline", connecting: "Connecting…", open: "Connected", waiting: "Offline",
    reconnecting: "Reconnecting…", auth: "API key needed",
  }[state] || state;
  el.status.title = el.statusText.textContent;
  clearInterval(bannerTimer);
  bannerTimer = null;
  if (state === "open" || state === "connecting") {
    el.banner.hidden = true;
  } else if (state === "auth") {
    showBanner("auth", "This server needs an API key.", "Enter key");
  } else if (state === "waiting") {
    const tick = () => {
      const secs = Math.max(0, Math.ceil((conn.retryAt - Date.now()) / 1000));
      const code = conn.lastClose?.code;
      const what = conn.everOpened || (code && code !== 1006)
        ? describeClose(code, conn.lastClose?.reason) : "Cannot reach the server";
      showBanner("warn", `${what}. Reconnecting in ${secs} s (attempt ${conn.attempt})…`,
                 "Retry now");
    };
    tick();
    bannerTimer = setInterval(tick, 500);
  } else if (state === "reconnecting") {
    showBanner("warn", "Reconnecting…", null);
  }
  updateComposer();
}

function showBanner(kind, text, action) {
  el.banner.hidden = false;
  el.banner.dataset.kind = kind;
  if (el.bannerText.textContent !== text) el.bannerText.textContent = text;
  el.bannerAction.hidden = !action;
  if (action) el.bannerAction.textContent = action;
}

el.bannerAction.addEventListener("click", () => {
  if (conn.state === "auth") openKeyDialog("This server asks for an API key.");
  else conn.retryNow();
});

// ---------------------------------------------------------------------------- API key

function openKeyDialog(text) {
  el.keyText.textContent = text;
  el.keyError.textContent = "";
  el.keyInput.value = "";
  if (!el.keyDialog.open) el.keyDialog.showModal();
  el.keyInput.focus();
}

el.keyForm.addEventListener("submit", (e) => {
  e.preventDefault();
  const key = el.keyInput.value.trim();
  if (!isValidKey(key)) {
    el.keyError.textContent = "A key is at least 8 characters of letters, digits and "
      + "-._~!#$%&'*+^`| (no spaces).";
    el.keyInput.setAttribute("aria-invalid", "true");
    return;
  }
  el.keyInput.removeAttribute("aria-invalid");
  try {
    localStorage.setItem(KEY_STORAGE, key);
  } catch {
    toast("Could not store the key in this browser; it is used for this page only.");
  }
  el.keyDialog.close();
  el.forgetKey.hidden = false;
  conn.retryNow();
});
el.keyCancel.addEventListener("click", () => el.keyDialog.close());
el.forgetKey.addEventListener("click", () => {
  localStorage.removeItem(KEY_STORAGE);
  el.forgetKey.hidden = true;
  conn.retryNow();
});

// ---------------------------------------------------------------------------- responses

function activeRun(convId) {
  for (const run of runs.values()) if (run.convId === convId) return run;
  return null;
}

/** Make the server's conversation equal to ``conv`` (its non-empty messages, in order). */
function reconcile(conv) {
  const desired = conv.messages.filter((m) => m.text.length > 0);
  let same = 0;
  while (same < mirror.length && same < desired.length
         && mirror[same].role === desired[same].role && mirror[same].text === desired[same].text) {
    same += 1;
  }
  for (const item of mirror.slice(same)) {
    const eventId = uid("sync_");
    syncOps.set(eventId, { op: "delete", id: item.id });
    conn.send({ type: "conversation.item.delete", event_id: eventId, item_id: item.id });
  }
  mirror = mirror.slice(0, same);
  for (const m of desired.slice(same)) {
    const item = { id: uid("item_"), role: m.role, text: m.text };
    const eventId = uid("sync_");
    syncOps.set(eventId, { op: "create", id: item.id });
    conn.send({ type: "conversation.item.create", event_id: eventId,
                item: { id: item.id, type: "message", role: m.role, content: m.text } });
    mirror.push(item);
  }
}

function responseParams(conv) {
  const p = { conversation: "none" };
  if (conv.system.trim()) p.instructions = conv.system;
  const o = store.params;
  if (typeof o.temperature === "number") p.temperature = o.temperature;
  if (typeof o.top_p === "number") p.top_p = o.top_p;
  if (typeof o.max_output_tokens === "number") p.max_output_tokens = o.max_output_tokens;
  if (o.speculation === false) p.speculation = { method: "off" };
  return p;
}

function requireConnection() {
  if (conn.isOpen) return true;
  toast(conn.state === "auth" ? "Not connected: the server needs an API key."
                              : "Not connected yet; try again once the connection is back.");
  return false;
}

function startResponse(conv) {
  reconcile(conv);
  const msg = { id: uid("m_"), role: "assistant", text: "", status: "streaming", stats: null,
                error: null };
  conv.messages.push(msg);
  const run = { eventId: uid("resp_"), responseId: null, convId: conv.id, msg,
                cancelRequested: false, tokens: 0, startedAt: performance.now(), firstAt: null,
                renderTimer: null, lastRender: 0, lastSave: 0 };
  runs.set(run.eventId, run);
  conn.send({ type: "response.create", event_id: run.eventId, response: responseParams(conv) });
  store.touch(conv);
  store.save();
  renderAll();
  scrollToBottom();
}

function sendMessage() {
  const text = el.input.value;
  const conv = store.current;
  if (!text.trim() || activeRun(conv.id) || !requireConnection()) return;
  conv.messages.push({ id: uid("m_"), role: "user", text, status: "completed", stats: null,
                       error: null });
  el.input.value = "";
  autosize();
  startResponse(conv);
}

function stopResponse(conv = store.current) {
  const run = activeRun(conv.id);
  if (!run || run.cancelRequested) return;
  run.cancelRequested = true;
  if (run.responseId) sendCancel(run); // else: as soon as response.created names it
  updateComposer();
}

function sendCancel(run) {
  conn.send({ type: "response.cancel", event_id: uid("cancel_"), response_id: run.responseId });
}

function regenerate() {
  const conv = store.current;
  const last = conv.messages.at(-1);
  if (!last || last.role !== "assistant" || activeRun(conv.id) || !requireConnection()) return;
  conv.messages.pop();
  startResponse(conv);
}

function saveEdit(text) {
  const conv = store.current;
  const index = conv.messages.findIndex((m) => m.id === editingId);
  editingId = null;
  if (index < 0 || !text.trim() || activeRun(conv.id) || !requireConnection()) {
    renderMessages();
    return;
  }
  conv.messages.splice(index);
  conv.messages.push({ id: uid("m_"), role: "user", text, status: "completed", stats: null,
                       error: null });
  startResponse(conv);
}

function onDelta(ev) {
  const run = byResponse.get(ev.response_id);
  if (!run) return;
  if (run.firstAt === null) run.firstAt = performance.now();
  run.tokens += ev.num_tokens || 0;
  run.msg.text += ev.delta || "";
  if (run.renderTimer === null) {
    const wait = Math.max(0, RENDER_INTERVAL_MS - (performance.now() - run.lastRender));
    run.renderTimer = setTimeout(() => renderStreaming(run), wait);
  }
}

function renderStreaming(run) {
  run.renderTimer = null;
  run.lastRender = performance.now();
  if (run.lastRender - run.lastSave > SAVE_INTERVAL_MS) {
    run.lastSave = run.lastRender;
    store.save(); // a reload mid-answer keeps what was streamed
  }
  const nodes = msgNodes.get(run.msg.id);
  if (run.convId !== store.currentId || !nodes) return;
  keepScroll(() => {
    renderMarkdown(run.msg.text, nodes.body, { final: false });
    setMeta(nodes.meta, liveStats(run), null);
  });
}

function onDone(resp, clientEventId) {
  const run = byResponse.get(resp.id) || runs.get(clientEventId);
  if (!run) return;
  const msg = run.msg;
  const parts = resp.output?.[0]?.content || [];
  const text = parts.map((p) => p.text || "").join("");
  if (resp.status === "completed" || text.length >= msg.text.length) msg.text = text || msg.text;
  msg.status = resp.status; // completed | cancelled | failed
  msg.stats = resp.usage ? { usage: resp.usage, timings: resp.timings,
                             speculation: resp.speculation, finish_reason: resp.finish_reason,
                             client_ttft_ms: run.firstAt === null ? null
                               : Math.round(run.firstAt - run.startedAt) } : null;
  const details = resp.status_details || {};
  if (resp.status === "failed" && !msg.error) {
    msg.error = { message: details.error?.message || "The answer failed.",
                  code: details.error?.code || null };
  }
  if (resp.status === "cancelled" && details.reason === "server_shutdown") {
    msg.error = { message: "The server shut down before the answer finished.",
                  code: "server_shutdown" };
  }
  endRun(run);
}

function endRun(run) {
  clearTimeout(run.renderTimer);
  runs.delete(run.eventId);
  if (run.responseId) byResponse.delete(run.responseId);
  const conv = store.get(run.convId);
  if (conv) {
    store.touch(conv);
    store.save();
  }
  renderSidebar();
  if (run.convId === store.currentId) renderMessages();
  updateComposer();
}

function onError(ev) {
  const err = ev.error || {};
  const info = { message: err.message || "Unknown error", code: err.code || null };
  const byResp = ev.response_id && byResponse.get(ev.response_id);
  if (byResp) {
    byResp.msg.error = info; // its response.done (failed) follows
    return;
  }
  const eventId = ev.client_event_id || "";
  const run = runs.get(eventId);
  if (run) { // refused before a response existed (invalid value, rate limit, ...)
    run.msg.status = "failed";
    run.msg.error = info;
    endRun(run);
    return;
  }
  const op = syncOps.get(eventId);
  if (op) {
    syncOps.delete(eventId);
    if (op.op === "create") mirror = mirror.filter((m) => m.id !== op.id); // it was not created
    if (info.code === "item_not_found") return; // already gone: what we wanted
  }
  if (eventId.startsWith("cancel_") && info.code === "response_not_active") return; // it ended
  toast(info.message, info.code);
}

// ---------------------------------------------------------------------------- rendering

function renderAll() {
  renderSidebar();
  renderConversation();
  updateComposer();
}

function renderConversation() {
  const conv = store.current;
  el.title.textContent = conv.title;
  document.title = `${conv.title} · quickdraft`;
  if (document.activeElement !== el.system) el.system.value = conv.system;
  renderMessages();
}

function renderMessages() {
  const conv = store.current;
  const busy = activeRun(conv.id) !== null;
  let lastUser = -1;
  conv.messages.forEach((m, i) => { if (m.role === "user") lastUser = i; });
  msgNodes.clear();
  const fragment = document.createDocumentFragment();
  if (!conv.messages.length) fragment.append(emptyState());
  conv.messages.forEach((m, i) => {
    fragment.append(renderMessage(m, {
      canEdit: !busy && i === lastUser,
      canRegenerate: !busy && m.role === "assistant" && i === conv.messages.length - 1,
    }));
  });
  keepScroll(() => el.messages.replaceChildren(fragment));
  el.messages.setAttribute("aria-busy", busy ? "true" : "false");
}

function emptyState() {
  const box = document.createElement("div");
  box.className = "empty";
  const h = document.createElement("h2");
  h.textContent = "How can I help?";
  const p = document.createElement("p");
  p.textContent = session ? `Chatting with ${session.model}.` : "Connecting to the server…";
  const p2 = document.createElement("p");
  p2.className = "hint";
  p2.textContent = "Enter sends · Shift+Enter new line · Esc stops the answer";
  box.append(h, p, p2);
  return box;
}

const ICONS = {
  copy: '<svg viewBox="0 0 24 24" aria-hidden="true"><rect x="9" y="9" width="11" height="11" rx="2"/><path d="M5 15V5a2 2 0 0 1 2-2h10"/></svg>',
  edit: '<svg viewBox="0 0 24 24" aria-hidden="true"><path d="M4 20h4L19 9l-4-4L4 16z"/></svg>',
  regenerate: '<svg viewBox="0 0 24 24" aria-hidden="true"><path d="M20 11a8 8 0 1 0-2.3 5.7M20 4v7h-7"/></svg>',
  rename: '<svg viewBox="0 0 24 24" aria-hidden="true"><path d="M4 20h4L19 9l-4-4L4 16z"/></svg>',
  trash: '<svg viewBox="0 0 24 24" aria-hidden="true"><path d="M4 7h16M10 11v6M14 11v6M6 7l1 13h10l1-13M9 7V4h6v3"/></svg>',
};

function actionButton(action, label, icon, text) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = `btn btn-ghost ${action}-msg`;
  b.dataset.action = action;
  b.setAttribute("aria-label", label);
  b.innerHTML = `${icon}<span>${text}</span>`; // constant markup, no user text
  return b;
}

const STATUS_TEXT = {
  cancelled: "Stopped",
  interrupted: "Interrupted",
  failed: "Failed",
};

function renderMessage(m, { canEdit, canRegenerate }) {
  const node = document.createElement("article");
  node.className = `msg msg-${m.role}`;
  node.dataset.id = m.id;
  node.dataset.role = m.role;
  node.dataset.status = m.status;
  node.setAttribute("aria-label", m.role === "user" ? "You" : "Assistant");

  if (m.role === "user" && m.id === editingId) {
    node.append(editBox(m));
    return node;
  }
  const body = document.createElement("div");
  body.className = m.role === "user" ? "msg-body" : "msg-body markdown";
  if (m.role === "user") body.textContent = m.text;
  else renderMarkdown(m.text, body, { final: m.status !== "streaming" });
  node.append(body);

  let meta = null;
  if (m.role === "assistant") {
    const label = m.status === "completed" && m.stats?.finish_reason === "length"
      ? "Stopped at the token limit" : STATUS_TEXT[m.status];
    if (label) {
      const s = document.createElement("div");
      s.className = "msg-status";
      s.textContent = label;
      node.append(s);
    }
    if (m.error) {
      const e = document.createElement("div");
      e.className = "msg-error";
      e.setAttribute("role", "note");
      e.textContent = m.error.message;
      if (m.error.code) {
        const c = document.createElement("code");
        c.textContent = ` (${m.error.code})`;
        e.append(c);
      }
      node.append(e);
    }
    meta = document.createElement("div");
    meta.className = "msg-meta";
    node.append(meta);
    const run = m.status === "streaming" ? [...runs.values()].find((r) => r.msg === m) : null;
    if (run) setMeta(meta, liveStats(run), null);
    else if (m.stats) setMeta(meta, ...formatStats(m.stats));
    else meta.hidden = true;
  }

  if (m.status !== "streaming") {
    const actions = document.createElement("div");
    actions.className = "msg-actions";
    if (m.text) actions.append(actionButton("copy", "Copy message", ICONS.copy, "Copy"));
    if (canEdit) actions.append(actionButton("edit", "Edit and resend", ICONS.edit, "Edit"));
    if (canRegenerate) {
      actions.append(actionButton("regenerate", "Regenerate the answer", ICONS.regenerate,
                                  "Regenerate"));
    }
    if (actions.childElementCount) node.append(actions);
  }
  msgNodes.set(m.id, { node, body, meta });
  return node;
}

function editBox(m) {
  const box = document.createElement("div");
  box.className = "edit-box";
  const area = document.createElement("textarea");
  area.value = m.text;
  area.setAttribute("aria-label", "Edit your message");
  area.className = "edit-input";
  const row = document.createElement("div");
  row.className = "row";
  const cancel = document.createElement("button");
  cancel.type = "button";
  cancel.className = "btn btn-small";
  cancel.dataset.action = "edit-cancel";
  cancel.textContent = "Cancel";
  const save = document.createElement("button");
  save.type = "button";
  save.className = "btn btn-small btn-primary";
  save.dataset.action = "edit-save";
  save.textContent = "Save & send";
  row.append(cancel, save);
  box.append(area, row);
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      saveEdit(area.value);
    } else if (e.key === "Escape") {
      e.preventDefault();
      e.stopPropagation();
      editingId = null;
      renderMessages();
    }
  });
  requestAnimationFrame(() => {
    area.focus();
    area.setSelectionRange(area.value.length, area.value.length);
  });
  return box;
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;
}

function liveStats(run) {
  if (run.firstAt === null) return "waiting for the first token…";
  const ttft = Math.round(run.firstAt - run.startedAt);
  const elapsed = (performance.now() - run.firstAt) / 1000;
  const rate = run.tokens > 1 && elapsed > 0 ? ` · ${((run.tokens - 1) / elapsed).toFixed(1)} tok/s` : "";
  return `${ttft} ms to first token${rate} · ${run.tokens} tokens`;
}

/** [line, tooltip] for a finished answer, from response.done's usage/timings/speculation. */
function formatStats({ usage, timings, speculation, finish_reason: finish, client_ttft_ms: clientTtft }) {
  const parts = [];
  const tip = [];
  const ttft = timings?.time_to_first_token;
  if (ttft !== null && ttft !== undefined) parts.push(`${fmtSeconds(ttft)} to first token`);
  const out = usage?.output_tokens ?? 0;
  const decode = timings?.decode_time ?? 0;
  const rate = out > 1 && decode > 0 ? (out - 1) / decode : null;
  if (rate !== null) parts.push(`${rate.toFixed(1)} tok/s`);
  parts.push(`${out} tokens`);
  if (speculation && speculation.drafted_tokens > 0) {
    parts.push(`speculation accepted ${speculation.accepted_tokens}/${speculation.drafted_tokens}`);
  } else if (speculation) {
    parts.push("no speculation");
  }
  tip.push(`Time to first token: ${fmtSeconds(ttft)} (server: arrival → first token)`);
  if (clientTtft !== null && clientTtft !== undefined) tip.push(`  in this browser: ${clientTtft} ms`);
  if (timings) tip.push(`Queue: ${fmtSeconds(timings.queue_time)}`);
  tip.push(`Decode: ${fmtSeconds(decode)} for ${out} tokens`
           + (rate !== null ? ` → ${rate.toFixed(1)} tokens/s` : ""));
  if (usage) tip.push(`Tokens: ${usage.input_tokens} in, ${out} out`);
  if (speculation) {
    const pct = speculation.drafted_tokens
      ? Math.round((100 * speculation.accepted_tokens) / speculation.drafted_tokens) : 0;
    tip.push(`Speculation: ${speculation.accepted_tokens} of ${speculation.drafted_tokens} drafted `
             + `tokens accepted (${pct} %) in ${speculation.num_steps} verification steps,`);
    tip.push(`  ${Number(speculation.mean_acceptance_length).toFixed(2)} tokens per step`);
  }
  if (finish) tip.push(`Finish: ${finish}`);
  return [parts.join(" · "), tip.join("\n")];
}

let tipCounter = 0;
function setMeta(meta, line, tip) {
  meta.hidden = false;
  meta.replaceChildren(document.createTextNode(line));
  if (tip) {
    const t = document.createElement("span");
    t.className = "tip";
    t.id = `tip-${++tipCounter}`;
    t.setAttribute("role", "tooltip");
    t.textContent = tip;
    meta.append(t);
    meta.tabIndex = 0;
    meta.setAttribute("aria-describedby", t.id);
    meta.title = ""; // the styled tooltip replaces the native one
  }
}

function keepScroll(fn) {
  const m = el.messages;
  const atBottom = m.scrollHeight - m.scrollTop - m.clientHeight < 80;
  const top = m.scrollTop;
  fn();
  m.scrollTop = atBottom ? m.scrollHeight : top;
}

function scrollToBottom() {
  el.messages.scrollTop = el.messages.scrollHeight;
}

function renderSidebar() {
  const fragment = document.createDocumentFragment();
  for (const conv of store.sorted()) {
    const li = document.createElement("li");
    li.className = "conv";
    li.dataset.id = conv.id;
    if (conv.id === store.currentId) li.setAttribute("aria-current", "true");
    if (conv.id === renamingId) {
      const input = document.createElement("input");
      input.className = "conv-rename-input";
      input.value = conv.title;
      input.setAttribute("aria-label", "Conversation name");
      input.addEventListener("keydown", (e) => {
        if (e.key === "Enter") {
          e.preventDefault();
          finishRename(conv.id, input.value);
        } else if (e.key === "Escape") {
          e.preventDefault();
          e.stopPropagation();
          finishRename(conv.id, null);
        }
      });
      input.addEventListener("blur", () => finishRename(conv.id, input.value));
      li.append(input);
      requestAnimationFrame(() => { input.focus(); input.select(); });
    } else {
      const open = document.createElement("button");
      open.type = "button";
      open.className = "conv-open";
      open.dataset.action = "open";
      open.textContent = conv.title;
      open.title = conv.title;
      if (activeRun(conv.id)) open.classList.add("conv-busy");
      const actions = document.createElement("span");
      actions.className = "conv-actions";
      const rename = document.createElement("button");
      rename.type = "button";
      rename.className = "btn btn-ghost conv-rename";
      rename.dataset.action = "rename";
      rename.setAttribute("aria-label", `Rename conversation “${conv.title}”`);
      rename.innerHTML = ICONS.rename;
      const del = document.createElement("button");
      del.type = "button";
      del.className = "btn btn-ghost conv-delete";
      del.dataset.action = "delete";
      del.setAttribute("aria-label", `Delete conversation “${conv.title}”`);
      del.innerHTML = ICONS.trash;
      actions.append(rename, del);
      li.append(open, actions);
    }
    fragment.append(li);
  }
  el.convList.replaceChildren(fragment);
}

function finishRename(id, title) {
  if (renamingId !== id) return;
  renamingId = null;
  if (title !== null) store.rename(id, title);
  renderSidebar();
  if (id === store.currentId) renderConversation();
}

el.convList.addEventListener("click", (e) => {
  const button = e.target.closest("button[data-action]");
  if (!button) return;
  const id = button.closest(".conv").dataset.id;
  const action = button.dataset.action;
  if (action === "open") {
    if (id !== store.currentId) {
      store.select(id);
      editingId = null;
      renderAll();
      scrollToBottom();
    }
    setSidebar(false);
    el.input.focus();
  } else if (action === "rename") {
    renamingId = id;
    renderSidebar();
  } else if (action === "delete") {
    if (!button.classList.contains("confirming")) { // a second click deletes
      button.classList.add("confirming");
      button.textContent = "Delete?";
      button.setAttribute("aria-label", "Confirm: delete this conversation");
      setTimeout(() => { if (button.isConnected) renderSidebar(); }, 4000);
      return;
    }
    const run = activeRun(id);
    if (run) {
      stopResponse(store.get(id));
      runs.delete(run.eventId); // its remaining events are ignored
      if (run.responseId) byResponse.delete(run.responseId);
    }
    store.remove(id);
    editingId = null;
    renderAll();
  }
});

function updateComposer() {
  const run = activeRun(store.currentId);
  el.stop.hidden = !run;
  el.send.hidden = Boolean(run);
  el.stop.disabled = Boolean(run && run.cancelRequested);
  el.send.disabled = !conn.isOpen;
}

function toast(message, code = null) {
  const t = document.createElement("div");
  t.className = "toast";
  const text = document.createElement("span");
  text.className = "toast-text";
  text.textContent = message;
  if (code) {
    const c = document.createElement("code");
    c.textContent = ` (${code})`;
    text.append(c);
  }
  const close = document.createElement("button");
  close.type = "button";
  close.className = "btn btn-ghost";
  close.setAttribute("aria-label", "Dismiss");
  close.textContent = "✕";
  close.addEventListener("click", () => t.remove());
  t.append(text, close);
  el.toasts.append(t);
  setTimeout(() => t.remove(), TOAST_MS);
}

// ---------------------------------------------------------------------------- messages area

el.messages.addEventListener("click", async (e) => {
  const copyCode = e.target.closest(".copy-code");
  if (copyCode) {
    const code = copyCode.closest(".code-block").querySelector("pre code");
    flash(copyCode, await copyText(code.textContent));
    return;
  }
  const button = e.target.closest("button[data-action]");
  if (!button) return;
  const node = button.closest(".msg");
  const conv = store.current;
  const msg = node && conv.messages.find((m) => m.id === node.dataset.id);
  switch (button.dataset.action) {
    case "copy":
      if (msg) flash(button, await copyText(msg.text));
      break;
    case "regenerate":
      regenerate();
      break;
    case "edit":
      if (msg && !activeRun(conv.id)) {
        editingId = msg.id;
        renderMessages();
      }
      break;
    case "edit-save":
      saveEdit(node.querySelector("textarea").value);
      break;
    case "edit-cancel":
      editingId = null;
      renderMessages();
      break;
    default:
      break;
  }
});

function flash(button, ok) {
  const label = button.querySelector("span");
  if (!label) return;
  const before = label.textContent;
  label.textContent = ok ? "Copied" : "Copy failed";
  button.classList.add("copied");
  setTimeout(() => {
    label.textContent = before;
    button.classList.remove("copied");
  }, 1500);
}

// ---------------------------------------------------------------------------- composer

function autosize() {
  el.input.style.height = "auto";
  el.input.style.height = `${Math.min(el.input.scrollHeight + 2, window.innerHeight * 0.4)}px`;
}

el.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  sendMessage();
});
el.input.addEventListener("input", autosize);
el.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) {
    e.preventDefault();
    sendMessage();
  }
});
el.stop.addEventListener("click", () => stopResponse());

document.addEventListener("keydown", (e) => {
  if (e.key !== "Escape" || el.keyDialog.open) return;
  if (activeRun(store.currentId)) {
    e.preventDefault();
    stopResponse();
  } else if (el.app.classList.contains("sidebar-open")) {
    setSidebar(false);
  }
});

// ---------------------------------------------------------------------------- sidebar, theme

const narrow = window.matchMedia("(max-width: 760px)");

function setSidebar(open) {
  el.app.classList.toggle("sidebar-open", open);
  el.toggleSidebar.setAttribute("aria-expanded", String(open));
  el.toggleSidebar.setAttribute("aria-label", open ? "Hide conversations" : "Show conversations");
  el.scrim.hidden = !open;
  el.sidebar.inert = narrow.matches && !open; // off-screen: not reachable with Tab
}
const PLACEHOLDER = el.input.placeholder;
function onWidthChange() {
  setSidebar(false);
  el.input.placeholder = narrow.matches ? "Message" : PLACEHOLDER; // the hint is in aria-describedby
}
narrow.addEventListener("change", onWidthChange);
el.toggleSidebar.addEventListener("click", () => setSidebar(!el.app.classList.contains("sidebar-open")));
el.scrim.addEventListener("click", () => setSidebar(false));

el.newChat.addEventListener("click", () => {
  const current = store.current;
  if (current.messages.length) store.create({ system: current.system });
  editingId = null;
  renderAll();
  setSidebar(false);
  el.input.focus();
});

const darkQuery = window.matchMedia("(prefers-color-scheme: dark)");
function effectiveTheme() {
  return document.documentElement.dataset.theme || (darkQuery.matches ? "dark" : "light");
}
function renderThemeButton() {
  const next = effectiveTheme() === "dark" ? "light" : "dark";
  el.themeToggle.setAttribute("aria-label", `Switch to ${next} theme`);
  el.themeToggle.title = `Switch to ${next} theme`;
}
el.themeToggle.addEventListener("click", () => {
  const next = effectiveTheme() === "dark" ? "light" : "dark";
  document.documentElement.dataset.theme = next;
  try {
    localStorage.setItem(THEME_STORAGE, next);
  } catch {
    // the choice holds for this page
  }
  renderThemeButton();
});
darkQuery.addEventListener("change", renderThemeButton);

// ---------------------------------------------------------------------------- settings

el.toggleSettings.addEventListener("click", () => {
  const open = el.settings.hidden;
  el.settings.hidden = !open;
  el.toggleSettings.setAttribute("aria-expanded", String(open));
  if (open) el.system.focus();
});

let systemSaveTimer = null;
el.system.addEventListener("input", () => {
  const conv = store.current;
  conv.system = el.system.value;
  clearTimeout(systemSaveTimer);
  systemSaveTimer = setTimeout(() => store.save(), 300);
});

const NUMBER_PARAMS = [
  { input: el.temperature, name: "temperature", min: 0, max: 100, int: false,
    valid: (v) => v >= 0 && v <= 100 },
  { input: el.topP, name: "top_p", int: false, valid: (v) => v > 0 && v <= 1 },
  { input: el.maxTokens, name: "max_output_tokens", int: true,
    valid: (v) => Number.isInteger(v) && v >= 1 },
];

function serverDefault(name) {
  if (!session) return null;
  const value = session[name];
  return value === "inf" ? null : value;
}

function renderParams() {
  for (const p of NUMBER_PARAMS) {
    const value = store.params[p.name] ?? serverDefault(p.name);
    if (document.activeElement !== p.input) p.input.value = value === null || value === undefined ? "" : String(value);
    p.input.removeAttribute("aria-invalid");
  }
  const spec = session?.speculation;
  el.speculation.checked = store.params.speculation ?? !(spec && spec.method === "off");
  if (session) {
    $("p-temperature-hint").textContent = `server default ${session.temperature} · 0 = greedy`;
    $("p-top-p-hint").textContent = `server default ${session.top_p} · (0, 1]`;
    $("p-max-tokens-hint").textContent = session.max_output_tokens === "inf"
      ? `server default: what the context leaves (${session.max_model_len} tokens)`
      : `server default ${session.max_output_tokens}`;
  }
  el.forgetKey.hidden = !storedKey();
}

for (const p of NUMBER_PARAMS) {
  p.input.addEventListener("change", () => {
    const raw = p.input.value.trim();
    if (raw === "") {
      store.setParam(p.name, null); // back to the server's default
      renderParams();
      return;
    }
    const value = Number(raw);
    if (!Number.isFinite(value) || !p.valid(value)) {
      p.input.setAttribute("aria-invalid", "true");
      return;
    }
    p.input.removeAttribute("aria-invalid");
    store.setParam(p.name, value);
  });
}
el.speculation.addEventListener("change", () => store.setParam("speculation", el.speculation.checked));
el.resetParams.addEventListener("click", () => {
  store.resetParams();
  renderParams();
});

// ---------------------------------------------------------------------------- start

window.addEventListener("storage", (e) => {
  if (e.key === KEY_STORAGE) renderParams();
});

// A small hook for tests and debugging: render text exactly as a model answer is rendered.
window.quickdraft = {
  get state() {
    return { connection: conn.state, session, currentId: store.currentId,
             conversations: store.conversations.length, streaming: runs.size, mirror };
  },
  addAssistantMessage(text) {
    const conv = store.current;
    conv.messages.push({ id: uid("m_"), role: "assistant", text, status: "completed",
                         stats: null, error: null });
    store.touch(conv);
    store.save();
    renderAll();
  },
  renderMarkdown,
  sanitize,
};

renderThemeButton();
renderParams();
onWidthChange();
renderAll();
renderConnection();
conn.start();
el.input.focus();
