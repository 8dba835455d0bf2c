// corelm's web chat: streams answers from /v1/chat/completions. No dependencies, nothing fetched
// from elsewhere. Model output is only ever shown through render(), which escapes every character
// of it before adding its own few tags, or through textContent.
"use strict";
(function () {
  const STORE = "corelm.chat.v1";        // localStorage: {messages: [{role, content, stats}], settings}
  const KEY = "corelm.apiKey";          // sessionStorage: the API key, when the server asks for one
  const $ = (id) => document.getElementById(id);

  // ---- rendering -----------------------------------------------------------------------------
  function escapeHtml(text) {
    return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  // Inline markup of already-escaped text: `code`, **strong**, *em* / _em_.
  function inline(escaped) {
    return escaped.split(/(`[^`\n]+`)/).map((part, i) => {
      if (i % 2 === 1) return "<code>" + part.slice(1, -1) + "</code>";
      return part.replace(/\*\*(?=\S)([^*]*?\S)\*\*/g, "<strong>$1</strong>")
        .replace(/(^|[^*\w])\*(?=\S)([^*\n]*?\S)\*(?![*\w])/g, "$1<em>$2</em>")
        .replace(/(^|[^\w])_(?=\S)([^_\n]*?\S)_(?![\w])/g, "$1<em>$2</em>");
    }).join("");
  }

  // A tiny markdown subset. The whole text is escaped first; only then are <pre><code>, <code>,
  // <strong>, <em>, <p> and <br> added around escaped text, so no tag or attribute can come from it.
  function render(text) {
    const escaped = escapeHtml(text);
    const out = [];
    // fenced code blocks; an unclosed fence (still streaming) runs to the end
    const fence = /(^|\n)```[^\n]*\n?([\s\S]*?)(\n```[ \t]*(?=\n|$)|$)/g;
    let last = 0, m;
    while ((m = fence.exec(escaped)) !== null) {
      if (m[0].length === 0) { fence.lastIndex++; continue; }
      out.push(paragraphs(escaped.slice(last, m.index)));
      out.push("<pre><code>" + m[2] + "</code></pre>");
      last = fence.lastIndex;
      if (last >= escaped.length) break;
    }
    out.push(paragraphs(escaped.slice(last)));
    return out.join("");
  }

  function paragraphs(escaped) {
    return escaped.split(/\n{2,}/).map((p) => p.trim()).filter((p) => p)
      .map((p) => "<p>" + inline(p).replace(/\n/g, "<br>") + "</p>").join("");
  }

  // ---- state ---------------------------------------------------------------------------------
  let state = load();
  let controller = null;                 // the AbortController of the answer being streamed

  function load() {
    try {
      const s = JSON.parse(localStorage.getItem(STORE) || "null");
      if (s && Array.isArray(s.messages)) return s;
    } catch (e) { /* a broken store starts over */ }
    return { messages: [], settings: {} };
  }
  function save() {
    try { localStorage.setItem(STORE, JSON.stringify(state)); } catch (e) { /* full: keep going */ }
  }
  function apiKey() { return sessionStorage.getItem(KEY) || ""; }
  function headers() {
    const h = { "Content-Type": "application/json" };
    if (apiKey()) h["Authorization"] = "Bearer " + apiKey();
    return h;
  }

  // ---- messages ------------------------------------------------------------------------------
  function addMessage(role, content, stats) {
    const div = document.createElement("div");
    div.className = "msg " + (role === "user" || role === "assistant" ? role : "error");
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    const body = document.createElement("div");
    body.className = "body";
    const info = document.createElement("div");
    info.className = "stats";
    div.append(label, body, info);
    $("messages").appendChild(div);
    setContent(div, content, stats);
    return div;
  }
  function setContent(div, content, stats) {
    const body = div.querySelector(".body");
    if (div.classList.contains("user")) body.textContent = content;   // the user's text, as typed
    else body.innerHTML = render(content);                            // escaped first: see render()
    div.querySelector(".stats").textContent = stats || "";
    const main = document.querySelector("main");
    main.scrollTop = main.scrollHeight;
  }
  function showAll() {
    $("messages").textContent = "";
    for (const m of state.messages) addMessage(m.role, m.content, m.stats);
  }

  // ---- settings ------------------------------------------------------------------------------
  const FIELDS = { "system-prompt": "system", "temperature": "temperature", "top-p": "top_p", "max-tokens": "max_tokens" };
  function loadSettings() {
    for (const [id, name] of Object.entries(FIELDS)) {
      if (state.settings[name] !== undefined) $(id).value = state.settings[name];
      $(id).addEventListener("change", () => { state.settings[name] = $(id).value; save(); });
    }
  }
  function number(id, integer) {
    const v = integer ? parseInt($(id).value, 10) : parseFloat($(id).value);
    return Number.isFinite(v) ? v : undefined;
  }

  // ---- talking to the server -----------------------------------------------------------------
  async function checkServer() {
    let r;
    try { r = await fetch("/v1/models", { headers: headers() }); } catch (e) { return; }
    if (r.status === 401) { $("key-panel").hidden = false; $("key-error").hidden = !apiKey(); return; }
    $("key-panel").hidden = true;
    if (r.ok) {
      const data = await r.json();
      if (data.data && data.data[0]) $("model").textContent = data.data[0].id;
    }
  }

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
  }

  async function send(text) {
    if (controller || !text.trim()) return;
    state.messages.push({ role: "user", content: text });
    save();
    addMessage("user", text);
    const messages = [];
    const system = $("system-prompt").value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const m of state.messages) if (m.role === "user" || m.role === "assistant") messages.push({ role: m.role, content: m.content });
    const body = { messages, stream: true, stream_options: { include_usage: true },
                   temperature: number("temperature"), top_p: number("top-p"), max_tokens: number("max-tokens", true) };
    const answer = { role: "assistant", content: "", stats: "" };
    const div = addMessage("assistant", "");
    controller = new AbortController();
    setBusy(true);
    const start = performance.now();
    let first = null, chunks = 0, usage = null, stopped = false, failed = null;
    const show = () => {
      const secs = first === null ? 0 : (performance.now() - first) / 1000;
      const n = usage ? usage.completion_tokens : chunks;
      answer.stats = n + " tokens" + (secs > 0 ? ", " + (n / secs).toFixed(1) + " tokens/s" : "") + (stopped ? " (stopped)" : "");
      $("status").textContent = answer.stats;
      setContent(div, answer.content, answer.stats);
    };
    try {
      const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                                       signal: controller.signal });
      if (!r.ok) {
        let message = "The server answered " + r.status + ".";
        try { message = (await r.json()).error.message || message; } catch (e) { /* not JSON */ }
        if (r.status === 401) checkServer();
        throw new Error(message);
      }
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let at;
        while ((at = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, at);
          buffer = buffer.slice(at + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data:")) continue;
            const data = line.slice(5).trim();
            if (data === "[DONE]") continue;
            const obj = JSON.parse(data);
            if (obj.error) throw new Error(obj.error.message || "The server failed.");
            if (obj.usage) usage = obj.usage;
            for (const c of obj.choices || []) {
              const piece = c.delta && c.delta.content;
              if (piece) {
                if (first === null) first = performance.now();
                chunks++;
                answer.content += piece;
              }
            }
          }
          show();
        }
      }
    } catch (e) {
      if (e.name === "AbortError") stopped = true;
      else failed = e.message || String(e);
    } finally {
      controller = null;
      setBusy(false);
      if (first === null) first = start;
      show();
      if (answer.content || !failed) { state.messages.push(answer); save(); }
      if (failed) {
        if (!answer.content) div.remove();
        addMessage("error", failed);
      }
    }
  }

  // ---- wiring --------------------------------------------------------------------------------
  document.addEventListener("DOMContentLoaded", () => {
    loadSettings();
    showAll();
    checkServer();
    $("composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = $("input").value;
      if (!text.trim() || controller) return;
      $("input").value = "";
      send(text);
    });
    $("input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
    });
    $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
    $("new-chat").addEventListener("click", () => {
      if (controller) controller.abort();
      state.messages = [];
      save();
      showAll();
      $("status").textContent = "";
    });
    $("toggle-settings").addEventListener("click", () => {
      const panel = $("settings");
      panel.hidden = !panel.hidden;
      $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
    });
    $("save-key").addEventListener("click", () => {
      sessionStorage.setItem(KEY, $("api-key").value.trim());
      $("api-key").value = "";
      checkServer();
    });
  });

  window.corelmChat = { render, escapeHtml, send, addMessage };
})();
