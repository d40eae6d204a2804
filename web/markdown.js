// Markdown rendering for model output, which is untrusted: marked (GitHub-flavoured Markdown)
// -> DOMPurify (sanitise the HTML) -> DOM, then highlight.js on the code blocks and a copy
// button on each. Every assistant message, streamed or restored, goes through renderMarkdown.

import { Marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.js";
import hljs from "./vendor/highlight.min.js";

const marked = new Marked({ gfm: true, breaks: false });

const PURIFY_CONFIG = {
  USE_PROFILES: { html: true }, // no SVG / MathML
  FORBID_TAGS: ["style", "form", "button", "dialog", "iframe", "object", "embed", "link", "meta"],
  FORBID_ATTR: ["style", "autofocus"], // no CSS overlays over the page
  SANITIZE_NAMED_PROPS: true, // id/name get a prefix: output cannot clobber the page's ids
  RETURN_DOM_FRAGMENT: true,
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
  if (node.tagName === "INPUT") node.setAttribute("disabled", ""); // GFM task list boxes
});

const COPY_ICON = '<svg viewBox="0 0 24 24" aria-hidden="true"><rect x="9" y="9" width="11" height="11" rx="2"/><path d="M5 15V5a2 2 0 0 1 2-2h10"/></svg>';

/** Render ``text`` (Markdown from the model) into ``container``, replacing its content.
 *  ``final``: the text is complete (auto-detect the language of unlabelled code blocks, which
 *  is too slow to redo on every streamed delta). */
export function renderMarkdown(text, container, { final = true } = {}) {
  const html = marked.parse(text ?? "", { async: false });
  const fragment = DOMPurify.sanitize(html, PURIFY_CONFIG);
  container.replaceChildren(fragment);
  for (const code of container.querySelectorAll("pre > code")) decorateCodeBlock(code, final);
}

/** The sanitiser alone, on an HTML string (exposed for tests). */
export function sanitize(html) {
  return DOMPurify.sanitize(html, { ...PURIFY_CONFIG, RETURN_DOM_FRAGMENT: false });
}

function decorateCodeBlock(code, final) {
  const pre = code.parentElement;
  const match = /(?:^|\s)language-([\w+#.-]+)/.exec(code.className);
  const lang = match ? match[1].toLowerCase() : "";
  const source = code.textContent;
  let result = null;
  try {
    if (lang && hljs.getLanguage(lang)) {
      result = hljs.highlight(source, { language: lang, ignoreIllegals: true });
    } else if (!lang && final && source.length < 20000) {
      result = hljs.highlightAuto(source);
    }
  } catch {
    result = null; // plain text
  }
  if (result) code.innerHTML = result.value; // highlight.js escapes the source text
  code.classList.add("hljs");

  const block = document.createElement("div");
  block.className = "code-block";
  const head = document.createElement("div");
  head.className = "code-head";
  const label = document.createElement("span");
  label.textContent = lang || (result && result.language) || "text";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "btn btn-ghost copy-code";
  copy.setAttribute("aria-label", `Copy ${label.textContent} code`);
  copy.innerHTML = `${COPY_ICON}<span>Copy</span>`;
  head.append(label, copy);
  pre.replaceWith(block);
  block.append(head, pre);
}

/** Copy ``text`` to the clipboard; falls back to execCommand where the Clipboard API is absent
 *  (pages served over plain HTTP from a non-localhost address are not a secure context). */
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch {
      // fall through
    }
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.append(area);
  area.select();
  let ok = false;
  try {
    ok = document.execCommand("copy");
  } catch {
    ok = false;
  }
  area.remove();
  return ok;
}
