// The chat: streams /v1/chat/completions, renders answers with markdown.js, folds the
// thinking (reasoning_content), stops and regenerates, and keeps the settings (system prompt,
// sampling, API key) and the conversation in localStorage. Tells the expert panel
// (experts.js) when an answer starts and ends, so that it polls faster meanwhile. With
// several models (a router: /v1/models lists each with its status) the header's picker
// chooses the one that answers ("model" in each request; kept in localStorage) and tells
// the expert panel ("moe-model"), which then maps that model.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const SETTINGS = {system: "", temperature: "0.8", top_p: "0.95", max_tokens: "512", key: ""};
  const STORE = "moe-offload-settings";
  const history = [];          // {role, content, ...}: role and content go to the server
  let controller = null;       // the AbortController of the answer streaming now
  let conversation = 0;        // bumped by "New chat": an answer cut by it is not kept

  // ---- settings ---------------------------------------------------------------------------
  function loadSettings() {
    let saved = {};
    try { saved = JSON.parse(localStorage.getItem(STORE) || "{}"); } catch (e) { saved = {}; }
    for (const [name, value] of Object.entries(SETTINGS))
      $(name).value = saved[name] !== undefined ? saved[name] : value;
  }
  function saveSettings() {
    const out = {};
    for (const name of Object.keys(SETTINGS)) out[name] = $(name).value;
    localStorage.setItem(STORE, JSON.stringify(out));
  }
  for (const name of Object.keys(SETTINGS)) $(name).addEventListener("change", saveSettings);
  $("settings-reset").onclick = () => {
    for (const [name, value] of Object.entries(SETTINGS)) if (name !== "key") $(name).value = value;
    saveSettings();
  };
  $("settings-toggle").onclick = () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
  };
  loadSettings();

  function headers() {
    const h = {"Content-Type": "application/json"};
    if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
    return h;
  }
  window.moeHeaders = headers;            // the expert panel sends the same key

  function number(id, parse) {
    const v = parse($(id).value);
    return Number.isFinite(v) ? v : parse(SETTINGS[id]);
  }
  function requestBody() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({role: "system", content: system});
    for (const m of history) messages.push({role: m.role, content: m.content});
    const model = $("model").value ? {model: $("model").value} : {};
    return {...model, messages, stream: true, stream_options: {include_usage: true},
            timings_per_token: true, max_tokens: Math.max(1, number("max_tokens", parseInt)),
            temperature: number("temperature", parseFloat), top_p: number("top_p", parseFloat)};
  }

  // ---- the server's name and health ------------------------------------------------------
  async function health() {
    try {
      const r = await fetch("/health");
      $("health").className = "dot " + (r.ok ? "ok" : "bad");
      $("health").title = r.ok ? "ready" : "not ready (" + r.status + ")";
    } catch (e) {
      $("health").className = "dot bad"; $("health").title = "unreachable";
    }
  }
  health();
  setInterval(health, 10000);

  // ---- the models: one, or several behind a router (each with its status) ---------------
  const MODEL = "moe-offload-model";
  let router = false, status = {};     // a router's models: id -> "loaded", "sleeping" ...
  // the expert panel's model: null with one model, else {name, status}
  window.moeModel = () => router ? {name: $("model").value, status: status[$("model").value]}
    : null;
  let listed;
  window.moeModelsListed = new Promise((resolve) => { listed = resolve; });
  async function listModels() {
    let data;
    try {
      const r = await fetch("/v1/models", {headers: headers()});
      data = (await r.json()).data;
    } catch (e) { return; } finally { listed(); }
    if (!Array.isArray(data) || !data.length) return;
    const picker = $("model");
    const wanted = picker.value || localStorage.getItem(MODEL) || "";
    router = data.some((m) => m.status && typeof m.status === "object");
    status = Object.fromEntries(data.map((m) => [m.id, m.status && m.status.value]));
    picker.textContent = "";
    for (const m of data) {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = router ? m.id + " · " + m.status.value : m.id;
      picker.appendChild(option);
    }
    if (data.some((m) => m.id === wanted)) picker.value = wanted;
    picker.disabled = data.length < 2;
    picker.title = router ? "the model that answers (loaded when first asked)"
      : "the model this server runs";
    if (router && picker.value !== wanted) document.dispatchEvent(new CustomEvent("moe-model"));
  }
  $("model").onchange = () => {
    localStorage.setItem(MODEL, $("model").value);
    document.dispatchEvent(new CustomEvent("moe-model"));
  };
  listModels();
  setInterval(listModels, 10000);
  document.addEventListener("moe-answer", (e) => { if (!e.detail) listModels(); });

  // ---- messages ---------------------------------------------------------------------------
  function scrollDown(force) {
    const log = $("log");
    if (force || log.scrollHeight - log.scrollTop - log.clientHeight < 120)
      log.scrollTop = log.scrollHeight;
  }
  function addMessage(role) {
    $("empty").hidden = true;
    const div = document.createElement("div");
    div.className = "msg " + role;
    const bubble = document.createElement("div");
    bubble.className = "bubble";
    div.appendChild(bubble);
    $("log").appendChild(div);
    return div;
  }
  function userMessage(text) {
    addMessage("user").firstChild.textContent = text;
    scrollDown(true);
  }

  // An answer in the page: the folded thinking, the rendered text, the line under it.
  class Answer {
    constructor() {
      this.div = addMessage("assistant");
      this.bubble = this.div.firstChild;
      this.bubble.classList.add("streaming");
      this.meta = document.createElement("div");
      this.meta.className = "meta";
      this.div.appendChild(this.meta);
      this.content = ""; this.reasoning = "";
      this.tokens = 0; this.started = performance.now(); this.first = 0;
      this.thinking = null; this.pending = false; this.done = false;
    }
    add(delta) {
      const text = delta.content || "", thought = delta.reasoning_content || "";
      if (!text && !thought) return;
      if (!this.first) this.first = performance.now();
      this.tokens++;                       // one frame per token
      this.content += text; this.reasoning += thought;
      if (!this.pending) {                 // render once per frame, however fast tokens come
        this.pending = true;
        requestAnimationFrame(() => { this.pending = false; this.render(); });
      }
    }
    render() {
      if (this.reasoning) {
        if (!this.thinking) {
          this.thinking = document.createElement("details");
          this.thinking.className = "reasoning";
          this.thinking.innerHTML = "<summary>Thinking…</summary><div class=\"md\"></div>";
          this.div.insertBefore(this.thinking, this.bubble);
        }
        this.thinking.lastChild.innerHTML = renderMarkdown(this.reasoning);
        if (this.content && this.thinking.dataset.done !== "1") {
          this.thinking.dataset.done = "1";
          const s = ((this.thinkingEnd = performance.now()) - this.started) / 1000;
          this.thinking.firstChild.textContent = "Thought for " + s.toFixed(1) + " s";
        }
      }
      this.bubble.innerHTML = renderMarkdown(this.content);
      this.live();
      scrollDown(false);
    }
    rate() {
      const s = (performance.now() - this.first) / 1000;
      return this.tokens > 1 && s > 0 ? (this.tokens - 1) / s : 0;
    }
    live() {
      if (this.first && !this.done) this.meta.textContent = this.tokens + " tokens · "
        + this.rate().toFixed(1) + " tokens/s";
    }
    // the answer ended (how: its finish_reason, or "stopped"); `saved`: an answer restored
    // from localStorage, with its line as it was
    finish(how, timings, saved) {
      this.render();
      this.done = true;
      this.how = how;
      this.bubble.classList.remove("streaming");
      const seconds = (performance.now() - this.started) / 1000;
      if (this.thinking && (saved || !this.thinking.dataset.done))
        this.thinking.firstChild.textContent = saved ? String(saved.thought || "Thought")
          : "Thought for " + seconds.toFixed(1) + " s";
      if (saved) {
        this.statsText = String(saved.stats || "");
      } else {
        const tokens = timings && timings.predicted_n ? timings.predicted_n : this.tokens;
        const rate = timings && timings.predicted_per_second ? timings.predicted_per_second
          : this.rate();
        this.statsText = tokens + " tokens · " + rate.toFixed(1) + " tokens/s · "
          + seconds.toFixed(1) + " s";
        if (timings && timings.wake_ms)      // the model was loaded (or woken) for it
          this.statsText += " · model loaded in " + (timings.wake_ms / 1000).toFixed(1) + " s";
      }
      this.meta.textContent = "";
      const stats = document.createElement("span");
      stats.className = "stats";
      stats.textContent = this.statsText;
      this.meta.appendChild(stats);
      if (how === "stopped" || how === "length") {
        const note = document.createElement("span");
        note.className = "stopped";
        note.textContent = how === "stopped" ? "stopped" : "max tokens reached";
        this.meta.appendChild(note);
      }
      const copy = document.createElement("button");
      copy.type = "button"; copy.textContent = "Copy";
      copy.onclick = () => navigator.clipboard && navigator.clipboard.writeText(this.content);
      this.meta.appendChild(copy);
      const again = document.createElement("button");
      again.type = "button"; again.textContent = "Regenerate"; again.className = "regenerate";
      again.onclick = regenerate;
      this.meta.appendChild(again);
    }
    // what the conversation keeps of it (history, and localStorage across reloads)
    record() {
      return {role: "assistant", content: this.content, reasoning: this.reasoning,
              stats: this.statsText || "", how: this.how || "", error: this.error || "",
              thought: this.thinking ? this.thinking.firstChild.textContent : ""};
    }
    fail(message) {
      this.done = true;
      this.error = message;
      this.bubble.classList.remove("streaming");
      this.div.classList.add("error");
      const p = document.createElement("p");
      p.textContent = message;
      this.bubble.appendChild(p);
    }
  }

  // Server-sent events: blank-line separated ("\n\n" or "\r\n\r\n", as sse-starlette sends),
  // "data:" lines joined; comments (": ping") and other fields skipped.
  function* events(buffer, final) {
    const parts = buffer.text.split(/\r?\n\r?\n|\r\r/);
    buffer.text = final ? "" : parts.pop();
    for (const part of parts) {
      const data = part.split(/\r?\n|\r/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(l[5] === " " ? 6 : 5)).join("\n");
      if (data) yield data;
    }
  }

  async function stream(answer) {
    controller = new AbortController();
    lastAnswer = answer;
    const mine = conversation;
    onlyLastRegenerates(answer.div);
    document.dispatchEvent(new CustomEvent("moe-answer", {detail: true}));
    $("send").hidden = true; $("stop").hidden = false;
    let how = "stopped", timings = null;
    try {
      const res = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(), signal: controller.signal,
        body: JSON.stringify(requestBody())});
      if (!res.ok) {
        const body = await res.json().catch(() => ({}));
        throw new Error((body.error && body.error.message) || res.status + " " + res.statusText);
      }
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      const buffer = {text: ""};
      for (let done = false; !done;) {
        const chunk = await reader.read();
        done = chunk.done;
        buffer.text += done ? decoder.decode() : decoder.decode(chunk.value, {stream: true});
        for (const data of events(buffer, done)) {
          if (data === "[DONE]") continue;
          const frame = JSON.parse(data);
          if (frame.error) throw new Error(frame.error.message || "the server failed");
          if (frame.timings) timings = frame.timings;
          const choice = frame.choices && frame.choices[0];
          if (!choice) continue;
          if (choice.delta) answer.add(choice.delta);
          if (choice.finish_reason) how = choice.finish_reason;
        }
      }
      answer.finish(how, timings);
    } catch (err) {
      if (err.name === "AbortError") answer.finish("stopped", null);
      else { answer.render(); answer.fail(String(err.message || err)); }
    } finally {
      if (mine === conversation) { history.push(answer.record()); save(); }
      controller = null;
      $("send").hidden = false; $("stop").hidden = true;
      document.dispatchEvent(new CustomEvent("moe-answer", {detail: false}));
    }
  }

  // what the answer cost in experts, from the expert panel's update after it
  let lastAnswer = null;
  document.addEventListener("moe-answer-experts", (e) => {
    const d = e.detail;
    if (!lastAnswer || !lastAnswer.done || !d.accesses) return;
    const span = document.createElement("span");
    span.className = "experts";
    span.title = "expert accesses served by resident experts, and bytes moved in, during "
      + "this answer";
    const mib = d.moved / 1048576;
    span.textContent = "experts: " + (100 * d.hits / d.accesses).toFixed(0) + " % hits · "
      + (mib >= 10 ? mib.toFixed(0) : mib.toFixed(1)) + " MiB moved in";
    const stats = lastAnswer.meta.querySelector(".stats");
    if (stats) stats.after(span);
  });

  // only the last answer can be asked again
  function onlyLastRegenerates(last) {
    for (const button of $("log").querySelectorAll(".regenerate"))
      if (!last.contains(button)) button.remove();
  }

  // the conversation survives a reload (localStorage; "New chat" forgets it)
  const CHAT = "moe-offload-chat";
  function save() {
    try { localStorage.setItem(CHAT, JSON.stringify(history)); } catch (e) { /* full */ }
  }
  function restore() {
    let saved = [];
    try { saved = JSON.parse(localStorage.getItem(CHAT) || "[]"); } catch (e) { saved = []; }
    if (!Array.isArray(saved)) return;
    let last = null;
    for (const m of saved) {
      if (!m || typeof m.content !== "string" || (m.role !== "user" && m.role !== "assistant"))
        continue;
      history.push(m);
      if (m.role === "user") { userMessage(m.content); continue; }
      last = new Answer();
      last.content = m.content;
      last.reasoning = typeof m.reasoning === "string" ? m.reasoning : "";
      if (m.error) { last.render(); last.fail(String(m.error)); }
      else last.finish(String(m.how || "stop"), null, m);
    }
    if (last) onlyLastRegenerates(last.div);
  }

  function send(text) {
    history.push({role: "user", content: text});
    save();
    userMessage(text);
    return stream(new Answer());
  }

  function regenerate() {
    if (controller) return;
    // drop the last answer (page and history), then ask again
    const answers = $("log").querySelectorAll(".msg.assistant");
    const last = answers[answers.length - 1];
    if (!last || history.length === 0 || history[history.length - 1].role !== "assistant") return;
    history.pop();
    save();
    last.remove();
    stream(new Answer());
  }

  $("composer").onsubmit = (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (text && !controller) { $("input").value = ""; grow(); send(text); }
  };
  function grow() {
    const input = $("input");
    input.style.height = "auto";
    input.style.height = Math.min(input.scrollHeight + 2, window.innerHeight * 0.4) + "px";
  }
  $("input").addEventListener("input", grow);
  $("input").onkeydown = (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  };
  $("stop").onclick = () => controller && controller.abort();
  document.addEventListener("keydown", (e) => {       // Escape stops the answer, as Stop does
    if (e.key === "Escape" && controller) controller.abort();
  });
  $("clear").onclick = () => {
    conversation++;
    if (controller) controller.abort();
    history.length = 0;
    save();
    for (const m of $("log").querySelectorAll(".msg")) m.remove();
    $("empty").hidden = false;
  };
  $("log").addEventListener("click", (e) => {   // a code block's Copy button
    const button = e.target.closest(".copy");
    if (!button || !navigator.clipboard) return;
    navigator.clipboard.writeText(button.closest(".code").querySelector("code").textContent);
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1200);
  });
  restore();
  if ("serviceWorker" in navigator) navigator.serviceWorker.register("/sw.js").catch(() => {});
})();
