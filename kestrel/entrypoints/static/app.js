// The kestrel playground: chat through POST v1/chat/completions (server-sent events read from fetch's stream),
// and a live view of the Prometheus text at GET metrics. Plain JS, no dependencies, no build step.
// URLs are relative, so the page works under a --root-path (or a proxy's prefix) as well as at "/".
"use strict";

(() => {
  const POLL_MS = 1000;
  const HISTORY = 120; // samples kept and plotted: two minutes at one a second

  const $ = (id) => document.getElementById(id);
  const el = {
    apiKey: $("api-key"), model: $("model"), refresh: $("refresh-models"), status: $("status"),
    system: $("system-prompt"), log: $("chat-log"), form: $("chat-form"), prompt: $("prompt"),
    send: $("send"), stop: $("stop"), clear: $("clear"), stats: $("chat-stats"),
    temperature: $("temperature"), topP: $("top-p"), maxTokens: $("max-tokens"), seed: $("seed"),
    metricsStatus: $("metrics-status"), running: $("m-running"), waiting: $("m-waiting"), kv: $("m-kv"),
    kvMeter: $("m-kv-meter"), tps: $("m-tps"), chartTps: $("chart-tps"), chartRequests: $("chart-requests"),
  };

  // The key lives in this variable only: never in storage, cookies or the URL.
  const state = { messages: [], controller: null, samples: [], previous: null };
  window.kestrelPlayground = state; // for debugging and the browser test

  function authHeaders() {
    const key = el.apiKey.value.trim();
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  function setStatus(text, isError = false) {
    el.status.textContent = text;
    el.status.classList.toggle("error", isError);
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
    } catch (_) { /* not JSON */ }
    return `HTTP ${response.status}`;
  }

  // ----- models -------------------------------------------------------------------------------------

  async function loadModels() {
    const previous = el.model.value;
    let response;
    try {
      response = await fetch("v1/models", { headers: authHeaders(), cache: "no-store" });
    } catch (e) {
      setStatus(`server unreachable: ${e.message}`, true);
      return;
    }
    if (!response.ok) {
      el.model.replaceChildren();
      const hint = response.status === 401 ? " (enter the server's API key)" : "";
      setStatus(`models: ${await errorText(response)}${hint}`, true);
      return;
    }
    const ids = ((await response.json()).data || []).map((card) => card.id);
    el.model.replaceChildren(...ids.map((id) => new Option(id, id)));
    if (ids.includes(previous)) el.model.value = previous;
    setStatus(`${ids.length} model${ids.length === 1 ? "" : "s"}`);
  }

  let keyTimer = null;
  el.apiKey.addEventListener("input", () => {
    clearTimeout(keyTimer);
    keyTimer = setTimeout(loadModels, 300);
  });
  el.apiKey.addEventListener("change", loadModels);
  el.refresh.addEventListener("click", loadModels);

  // ----- chat ---------------------------------------------------------------------------------------

  function addMessage(role, text) {
    const box = document.createElement("div");
    box.className = `msg ${role}`;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text; // model output is text, never markup
    box.append(label, content);
    el.log.append(box);
    el.log.scrollTop = el.log.scrollHeight;
    return box;
  }

  function number(input, parse) {
    const text = input.value.trim();
    if (text === "") return undefined;
    const value = parse(text);
    return Number.isFinite(value) ? value : undefined;
  }

  function requestBody(model) {
    const system = el.system.value.trim();
    const body = {
      model,
      messages: [...(system ? [{ role: "system", content: system }] : []), ...state.messages],
      stream: true,
      stream_options: { include_usage: true },
    };
    const fields = {
      temperature: number(el.temperature, parseFloat), top_p: number(el.topP, parseFloat),
      max_tokens: number(el.maxTokens, (t) => parseInt(t, 10)), seed: number(el.seed, (t) => parseInt(t, 10)),
    };
    for (const [name, value] of Object.entries(fields)) if (value !== undefined) body[name] = value;
    return body;
  }

  // Calls onEvent with each `data:` payload of a text/event-stream body; returns at `data: [DONE]` or its end.
  async function readEvents(stream, onEvent) {
    const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.match(/\r?\n\r?\n/)) !== null) {
        const event = buffer.slice(0, end.index);
        buffer = buffer.slice(end.index + end[0].length);
        const data = event.split(/\r?\n/).filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
        if (data === "") continue;
        if (data === "[DONE]") {
          reader.cancel().catch(() => {});
          return;
        }
        onEvent(JSON.parse(data));
      }
    }
  }

  function setBusy(busy) {
    el.send.disabled = busy;
    el.stop.disabled = !busy;
  }

  async function send() {
    const text = el.prompt.value.trim();
    if (!text || state.controller) return;
    const model = el.model.value;
    if (!model) {
      setStatus("no model selected: enter the API key or reload the model list", true);
      return;
    }
    el.prompt.value = "";
    state.messages.push({ role: "user", content: text });
    const user = addMessage("user", text);
    const body = requestBody(model);
    const answer = addMessage("assistant", "");
    const content = answer.querySelector(".content");
    answer.dataset.state = "streaming";
    el.stats.textContent = "";
    state.controller = new AbortController();
    setBusy(true);
    const started = performance.now();
    let firstToken = null;
    let finish = null;
    let usage = null;
    let chunks = 0;
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() },
        body: JSON.stringify(body), signal: state.controller.signal,
      });
      if (!response.ok) throw new Error(await errorText(response));
      await readEvents(response.body, (chunk) => {
        if (chunk.error) throw new Error(chunk.error.message || "the server ended the stream with an error");
        if (chunk.usage) usage = chunk.usage;
        const choice = (chunk.choices || [])[0];
        if (!choice) return;
        const delta = (choice.delta && choice.delta.content) || "";
        if (delta) {
          if (firstToken === null) firstToken = performance.now();
          content.textContent += delta;
          chunks += 1;
          answer.dataset.chunks = String(chunks);
          el.log.scrollTop = el.log.scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      });
      answer.dataset.state = "done";
    } catch (e) {
      if (e.name === "AbortError") {
        answer.dataset.state = "stopped";
      } else {
        answer.dataset.state = "error";
        const error = document.createElement("div");
        error.className = "error";
        error.textContent = e.message;
        answer.append(error);
      }
    } finally {
      state.controller = null;
      setBusy(false);
    }
    if (content.textContent) {
      state.messages.push({ role: "assistant", content: content.textContent });
    } else if (answer.dataset.state === "error") {
      state.messages.pop(); // nothing answered it: take the failed message out of the conversation
      user.classList.add("failed");
    }
    const seconds = (performance.now() - started) / 1000;
    const parts = [`${seconds.toFixed(2)} s`];
    if (firstToken !== null) parts.push(`first token ${((firstToken - started) / 1000).toFixed(2)} s`);
    if (usage) {
      parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
      parts.push(`${(usage.completion_tokens / seconds).toFixed(1)} tokens/s`);
    }
    if (finish) parts.push(`finish: ${finish}`);
    el.stats.textContent = parts.join(" \u00b7 ");
  }

  el.form.addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  el.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      el.form.requestSubmit();
    }
  });
  el.stop.addEventListener("click", () => state.controller && state.controller.abort());
  el.clear.addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    el.log.replaceChildren();
    el.stats.textContent = "";
  });

  // ----- metrics ------------------------------------------------------------------------------------

  // Prometheus text: the value of each series name, summed over its label sets.
  function parseMetrics(text) {
    const sums = new Map();
    for (const line of text.split("\n")) {
      if (line === "" || line.startsWith("#")) continue;
      const match = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)/);
      if (!match) continue;
      const value = parseFloat(match[3]);
      if (Number.isFinite(value)) sums.set(match[1], (sums.get(match[1]) || 0) + value);
    }
    // vLLM's names first; the same series under kestrel: otherwise.
    return (name) => sums.get(`vllm:${name}`) ?? sums.get(`kestrel:${name}`) ?? null;
  }

  async function pollMetrics() {
    try {
      const response = await fetch("metrics", { headers: authHeaders(), cache: "no-store" });
      if (!response.ok) throw new Error(await errorText(response));
      const metric = parseMetrics(await response.text());
      const now = performance.now();
      const generated = metric("generation_tokens_total");
      const sample = {
        time: now, running: metric("num_requests_running"), waiting: metric("num_requests_waiting"),
        kv: metric("kv_cache_usage_perc"), generated, tps: null,
      };
      const previous = state.previous;
      if (previous && generated !== null && previous.generated !== null && now > previous.time) {
        // a counter that went down is a restarted server: count from its new value
        sample.tps = Math.max(0, generated - previous.generated) / ((now - previous.time) / 1000);
      }
      state.previous = sample;
      state.samples.push(sample);
      if (state.samples.length > HISTORY) state.samples.shift();
      showSample(sample);
      el.metricsStatus.textContent = "live";
      el.metricsStatus.classList.remove("error");
    } catch (e) {
      el.metricsStatus.textContent = `metrics: ${e.message}`;
      el.metricsStatus.classList.add("error");
    } finally {
      setTimeout(pollMetrics, POLL_MS);
    }
  }

  const show = (value, digits = 0) => (value === null ? "\u2013" : value.toFixed(digits));

  function showSample(sample) {
    el.running.textContent = show(sample.running);
    el.waiting.textContent = show(sample.waiting);
    el.kv.textContent = sample.kv === null ? "\u2013" : `${(sample.kv * 100).toFixed(1)} %`;
    el.kvMeter.value = sample.kv || 0;
    el.tps.textContent = show(sample.tps, 1);
    drawCharts();
  }

  // ----- charts -------------------------------------------------------------------------------------

  function niceCeiling(value) {
    if (value <= 0) return 1;
    const power = 10 ** Math.floor(Math.log10(value));
    const step = [1, 2, 5, 10].find((s) => s * power >= value);
    return step * power;
  }

  function color(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
  }

  // One line per series over the last HISTORY samples, newest at the right; null values leave gaps.
  function drawChart(canvas, series, minTop) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || canvas.width;
    const height = canvas.clientHeight || canvas.height;
    if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
    if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const left = 34, right = 6, top = 8, bottom = 14;
    const plotW = width - left - right, plotH = height - top - bottom;
    const values = series.flatMap((s) => s.values.filter((v) => v !== null));
    const ceiling = niceCeiling(Math.max(minTop, ...values));
    ctx.font = "10px system-ui, sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    ctx.lineWidth = 1;
    for (let i = 0; i <= 2; i++) {
      const y = top + plotH - (plotH * i) / 2;
      ctx.strokeStyle = color("--grid");
      ctx.beginPath();
      ctx.moveTo(left, y + 0.5);
      ctx.lineTo(left + plotW, y + 0.5);
      ctx.stroke();
      ctx.fillStyle = color("--muted");
      const label = (ceiling * i) / 2;
      ctx.fillText(Number.isInteger(label) ? String(label) : label.toFixed(1), left - 4, y);
    }
    ctx.textAlign = "left";
    ctx.textBaseline = "bottom";
    ctx.fillText(`last ${Math.round((HISTORY * POLL_MS) / 1000)} s`, left, height);
    const x = (i, n) => left + plotW - ((n - 1 - i) * plotW) / (HISTORY - 1);
    const y = (v) => top + plotH - (Math.min(v, ceiling) / ceiling) * plotH;
    ctx.lineWidth = 1.5;
    ctx.lineJoin = "round";
    for (const s of series) {
      ctx.strokeStyle = color(s.color);
      ctx.beginPath();
      let drawing = false;
      s.values.forEach((v, i) => {
        if (v === null) {
          drawing = false;
          return;
        }
        if (drawing) ctx.lineTo(x(i, s.values.length), y(v));
        else ctx.moveTo(x(i, s.values.length), y(v));
        drawing = true;
      });
      ctx.stroke();
    }
    canvas.dataset.points = String(Math.max(...series.map((s) => s.values.filter((v) => v !== null).length)));
    canvas.dataset.last = series.map((s) => show(s.values[s.values.length - 1] ?? null, 2)).join(" ");
  }

  function drawCharts() {
    const samples = state.samples;
    drawChart(el.chartTps, [{ values: samples.map((s) => s.tps), color: "--tps" }], 1);
    drawChart(el.chartRequests, [
      { values: samples.map((s) => s.running), color: "--running" },
      { values: samples.map((s) => s.waiting), color: "--waiting" },
    ], 2);
  }

  window.addEventListener("resize", drawCharts);

  loadModels();
  pollMetrics();
})();
