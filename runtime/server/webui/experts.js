// The expert panel: polls GET /v1/residency (fast while an answer streams, slowly otherwise)
// and draws, for every device, its occupancy; a layers x experts heat map of where each
// expert lives (the fastest tier holding it: GPU, RAM, else storage, i.e. paged from the GGUF
// file) and how often the router picked it; and per phase the hit rate and bytes moved.
//
// After each answer it sends "moe-answer-experts" (accesses, hits, bytes moved in during it)
// for the chat to show. For tests and tools the canvas carries data-version (bumped whenever
// the map changes),
// data-routed (accesses so far, all experts) and data-resident (experts resident anywhere).
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const FAST_MS = 250, SLOW_MS = 2000, OFF_MS = 15000;
  // an expert's state in the map is "R" (resident) or "-" (absent): a decision takes effect
  // at once, so nothing is ever half-way in (runtime/residency/telemetry.py, STATE_CHARS)
  const COLORS = {gpu: [16, 185, 129], ram: [59, 130, 246], disk: [168, 162, 158]};
  const MOVED = [245, 158, 11];  // the activity chart's bars: bytes moved in
  const LABEL = {gpu: "GPU", ram: "RAM", disk: "storage"};
  let busy = false, timer = null, inFlight = false;
  let view = null;               // what the map shows now (for the tooltip)
  let lastRouted = null;         // routed counts at the previous update (change outlines)
  let signature = "", version = 0;

  // cpu and cpu-slots hold experts in host memory; every other device (cuda:N, vulkan:N,
  // rpc:...) is an accelerator
  const kindOf = (device) => device.startsWith("cpu") ? "ram" : "gpu";

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(n < 10 ? 1 : 0) : n) + " " + units[i];
  }
  const count = (n) => n >= 1e6 ? (n / 1e6).toFixed(1) + "M" : n >= 1e4
    ? (n / 1e3).toFixed(0) + "k" : String(n);

  function setStatus(text) { $("experts-status").textContent = text; }

  function schedule(ms) {
    clearTimeout(timer);
    timer = setTimeout(poll, ms);
  }
  // per answer: the totals before it and, at the first update after it, what it cost (the
  // chat shows it under the answer; another client's requests meanwhile count too)
  let answerFrom = null, answerDone = false;
  document.addEventListener("moe-answer", (e) => {
    busy = e.detail;
    if (busy) { answerFrom = lastTotals; answerDone = false; } else answerDone = true;
    schedule(0);                 // the answer's start, or its final counters
  });
  document.addEventListener("visibilitychange", () => { if (!document.hidden) schedule(0); });
  document.addEventListener("moe-model", () => {     // another model picked: its map
    lastRouted = null; lastTotals = null; signature = ""; answerFrom = null;
    schedule(0);
  });

  async function poll() {
    if (inFlight) return;
    inFlight = true;
    let delay = busy ? FAST_MS : SLOW_MS;
    try {
      const headers = window.moeHeaders ? window.moeHeaders() : {};
      // several models: the picked one's map, never loading (or waking) it just to look
      if (document.readyState === "loading")      // app.js (the model list) not run yet
        await new Promise((ok) => document.addEventListener("DOMContentLoaded", ok,
                                                            {once: true}));
      if (window.moeModelsListed) await window.moeModelsListed;
      const model = window.moeModel ? window.moeModel() : null;
      if (model && (model.status === "unloaded" || model.status === "sleeping")) {
        setStatus(model.status === "unloaded" ? "not loaded: the next message loads it"
          : "asleep (idle): the next message wakes it");
        $("experts-body").hidden = true;
        return;
      }
      const r = await fetch("/v1/residency" + (model ? "?autoload=false&model="
        + encodeURIComponent(model.name) : ""), {headers});
      if (r.ok) {
        update(await r.json());
      } else {
        const body = await r.json().catch(() => ({}));
        const code = body.error && body.error.code;
        if (r.status === 404) {
          setStatus("residency management is off for this model");
          delay = OFF_MS;
        } else if (r.status === 401) {
          setStatus("needs the API key (Settings)");
        } else if (code === "model_not_loaded") {
          setStatus("not loaded: the next message loads it");
        } else if (code === "model_sleeping") {
          setStatus("asleep (idle): the next message wakes it");
        } else if (code === "model_loading" || r.status === 503) {
          setStatus("waiting for the model…");
        } else {
          setStatus((body.error && body.error.message) || "error " + r.status);
        }
        $("experts-body").hidden = true;
      }
    } catch (e) {
      setStatus("server unreachable");
    } finally {
      inFlight = false;
      if (!document.hidden || busy) schedule(delay);
    }
  }

  // ---- the merged map: per (layer, expert) the fastest tier holding it --------------------
  function merge(devices) {
    const named = Object.entries(devices).filter(([, d]) => d.experts);
    if (!named.length) return null;
    const first = named[0][1].experts;
    const rows = first.layers.length, cols = rows ? first.state[0].length : 0;
    const where = new Array(rows * cols).fill("disk");
    const holder = new Array(rows * cols).fill("");
    const routed = new Float64Array(rows * cols);
    const rank = {gpu: 2, ram: 1, disk: 0};
    for (const [name, d] of named) {
      const kind = kindOf(name);
      for (let l = 0; l < rows; l++) {
        const state = d.experts.state[l], uses = d.experts.routed[l];
        for (let e = 0; e < cols; e++) {
          const i = l * cols + e;
          routed[i] = Math.max(routed[i], uses[e]);   // every device sees every access
          if (state[e] === "R" && rank[kind] > rank[where[i]]) {
            where[i] = kind; holder[i] = name;
          }
        }
      }
    }
    return {layers: first.layers, rows, cols, where, holder, routed};
  }

  function update(snapshot) {
    const devices = snapshot.devices || {};
    const map = merge(devices);
    $("experts-body").hidden = false;
    drawDevices(devices);
    drawPhases(devices);
    sample(devices);
    if (!map) { setStatus("no expert map in this snapshot"); return; }
    let total = 0, resident = 0;
    for (let i = 0; i < map.routed.length; i++) {
      total += map.routed[i];
      if (map.where[i] === "gpu" || map.where[i] === "ram") resident++;
    }
    const sig = total + "|" + map.where.join("");
    if (sig !== signature) { signature = sig; version++; }
    // outlined: routed since the previous update, while an answer streams
    const changed = busy && lastRouted && lastRouted.length === map.routed.length
      ? map.routed.map((v, i) => v - lastRouted[i]) : new Float64Array(map.routed.length);
    lastRouted = map.routed;
    view = {...map, changed};
    drawMap(view);
    const canvas = $("heatmap");
    canvas.dataset.version = String(version);
    canvas.dataset.routed = String(total);
    canvas.dataset.resident = String(resident);
    $("map-caption").textContent = map.rows + " layers × " + map.cols + " experts · "
      + resident + " resident";
    setStatus(busy ? "live" : "updated " + new Date().toLocaleTimeString());
  }

  // ---- recent activity: per update, the hit rate and the bytes moved in per second ------
  const samples = [];            // {rate: 0..1 | null, moved: bytes/s}
  let lastTotals = null;
  function sample(devices) {
    const now = performance.now();
    let accesses = 0, hits = 0, moved = 0;
    for (const d of Object.values(devices))
      for (const p of Object.values(d.phases)) {
        accesses += p.accesses; hits += p.hits;
        moved += p.admitted_bytes + p.prefetch_issued_bytes;
      }
    const last = lastTotals;
    lastTotals = {now, accesses, hits, moved};
    if (answerDone && !busy) {
      answerDone = false;
      if (answerFrom) document.dispatchEvent(new CustomEvent("moe-answer-experts", {detail: {
        accesses: accesses - answerFrom.accesses, hits: hits - answerFrom.hits,
        moved: moved - answerFrom.moved}}));
    }
    if (!last || (!busy && accesses === last.accesses)) return;
    const da = accesses - last.accesses, dt = Math.max(1e-3, (now - last.now) / 1000);
    samples.push({rate: da > 0 ? (hits - last.hits) / da : null,
                  moved: (moved - last.moved) / dt});
    if (samples.length > 60) samples.shift();
    drawActivity();
  }

  function drawActivity() {
    const canvas = $("activity");
    const width = canvas.clientWidth, height = 56;
    const dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const step = width / 60;
    const x0 = width - samples.length * step;
    let max = 1;
    for (const s of samples) max = Math.max(max, s.moved);
    ctx.fillStyle = "rgba(" + MOVED.join(",") + ",.55)";
    samples.forEach((s, i) => {
      const h = (height - 2) * s.moved / max;
      ctx.fillRect(x0 + i * step, height - h, Math.max(1, step - 1), h);
    });
    ctx.strokeStyle = getComputedStyle(document.documentElement).getPropertyValue("--accent");
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let open = false;
    samples.forEach((s, i) => {
      if (s.rate === null) { open = false; return; }
      const x = x0 + i * step + step / 2, y = 2 + (height - 4) * (1 - s.rate);
      if (open) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      open = true;
    });
    ctx.stroke();
    const last = samples[samples.length - 1];
    $("activity-now").textContent = last ? (last.rate === null ? "–"
      : (100 * last.rate).toFixed(0) + " % hits") + " · " + bytes(last.moved) + "/s" : "";
  }

  function drawDevices(devices) {
    const box = $("devices");
    box.textContent = "";
    for (const [name, d] of Object.entries(devices)) {
      const kind = kindOf(name);
      const div = document.createElement("div");
      div.className = "device";
      const row = document.createElement("div");
      row.className = "row";
      const label = document.createElement("span");
      label.innerHTML = '<i class="sw ' + kind + '"></i> ';
      const strong = document.createElement("span");
      strong.className = "name";
      strong.textContent = name;
      label.appendChild(strong);
      const info = document.createElement("span");
      info.className = "muted";
      info.textContent = d.capacity_bytes === null
        ? (d.note || "capacity not resolved")
        : bytes(d.resident_bytes) + " / " + bytes(d.capacity_bytes) + " · "
          + d.resident_experts + " experts";
      row.append(label, info);
      const bar = document.createElement("div");
      bar.className = "bar";
      const fill = document.createElement("i");
      const share = d.capacity_bytes ? Math.min(1, d.resident_bytes / d.capacity_bytes) : 0;
      fill.style.width = (share * 100).toFixed(1) + "%";
      fill.style.background = "rgb(" + COLORS[kind].join(",") + ")";
      bar.appendChild(fill);
      div.append(row, bar);
      box.appendChild(div);
    }
  }

  function drawPhases(devices) {
    const body = $("phases").tBodies[0];
    body.textContent = "";
    const many = Object.keys(devices).length > 1;
    for (const [name, d] of Object.entries(devices)) {
      if (many) {
        const tr = body.insertRow();
        const td = tr.insertCell();
        td.colSpan = 5; td.className = "device-row"; td.textContent = name;
      }
      for (const phase of ["prefill", "decode", "mixed"]) {
        const p = d.phases[phase];
        if (!p || (phase === "mixed" && !p.accesses)) continue;
        const tr = body.insertRow();
        tr.dataset.phase = phase;
        const rate = p.accesses ? (100 * p.hits / p.accesses).toFixed(1) + " %" : "–";
        for (const text of [phase, count(p.accesses), rate,
                            bytes(p.admitted_bytes + p.prefetch_issued_bytes),
                            bytes(p.evicted_bytes)])
          tr.insertCell().textContent = text;
      }
    }
  }

  function drawMap(m) {
    const canvas = $("heatmap");
    const gutter = 22;                             // px: layer numbers on the left
    const width = Math.max(120, canvas.parentElement.clientWidth);
    const cellW = (width - gutter) / Math.max(1, m.cols);
    let cellH = Math.min(Math.max(cellW, 4), 16);
    if (cellH * m.rows > 420) cellH = Math.max(2, 420 / m.rows);
    const height = Math.ceil(cellH * m.rows);
    const dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
    canvas.style.height = height + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    let max = 0;
    for (const v of m.routed) max = Math.max(max, v);
    const gap = cellW >= 6 && cellH >= 6 ? 1 : 0;
    const style = getComputedStyle(document.documentElement);
    ctx.fillStyle = style.getPropertyValue("--muted");
    ctx.font = "10px system-ui, sans-serif";
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    // a label every `every` rows, at least 12 px apart
    const every = [1, 2, 4, 5, 10, 20, 50, 100].find((n) => n * cellH >= 12) || 200;
    for (let l = 0; l < m.rows; l += every)
      ctx.fillText(String(m.layers[l]), gutter - 4,
                   Math.min(Math.max(l * cellH + cellH / 2, 5), height - 5));
    const dark = matchMedia("(prefers-color-scheme: dark)").matches;
    for (let l = 0; l < m.rows; l++) {
      for (let e = 0; e < m.cols; e++) {
        const i = l * m.cols + e;
        const v = m.routed[i];
        // brightness: the share of the busiest expert's count, on a log scale
        const t = v > 0 ? 0.22 + 0.78 * Math.log1p(v) / Math.log1p(max) : 0.08;
        const [r, g, b] = COLORS[m.where[i]];
        const small = cellW < 4 || cellH < 4;      // too small for an outline: solid instead
        const a = m.changed[i] > 0 && small ? 1 : t;
        ctx.fillStyle = "rgba(" + r + "," + g + "," + b + "," + a.toFixed(3) + ")";
        const x = gutter + e * cellW, y = l * cellH;
        ctx.fillRect(x, y, cellW - gap, cellH - gap);
        if (m.changed[i] > 0 && !small) {
          ctx.strokeStyle = dark ? "rgba(255,255,255,.8)" : "rgba(17,24,39,.6)";
          ctx.lineWidth = 1;
          ctx.strokeRect(x + 0.5, y + 0.5, cellW - gap - 1, cellH - gap - 1);
        }
      }
    }
    m.gutter = gutter; m.cellW = cellW; m.cellH = cellH;
  }

  // the tooltip: which expert, where it lives, how often it was routed
  $("heatmap").addEventListener("mousemove", (ev) => {
    const tip = $("map-tip");
    if (!view) return;
    const rect = ev.target.getBoundingClientRect();
    const e = Math.floor((ev.clientX - rect.left - view.gutter) / view.cellW);
    const l = Math.floor((ev.clientY - rect.top) / view.cellH);
    if (e < 0 || l < 0 || e >= view.cols || l >= view.rows) { tip.hidden = true; return; }
    const i = l * view.cols + e;
    const where = LABEL[view.where[i]] + (view.holder[i] ? " (" + view.holder[i] + ")" : "");
    tip.textContent = "layer " + view.layers[l] + " · expert " + e + " · " + where + " · routed "
      + view.routed[i] + "×" + (view.changed[i] > 0 ? " (+" + view.changed[i] + ")" : "");
    tip.hidden = false;
    const x = ev.clientX - rect.left + 12, y = ev.clientY - rect.top + 12;
    tip.style.left = Math.min(x, rect.width - tip.offsetWidth) + "px";
    tip.style.top = y + "px";
  });
  $("heatmap").addEventListener("mouseleave", () => { $("map-tip").hidden = true; });
  window.addEventListener("resize", () => { if (view) drawMap(view); });

  schedule(0);
})();
