// flashnorm-mlx serve's chat page: streams replies from /v1/chat/completions
// (the server's own SSE stream), shows each reply's speed from the stream's
// usage and timings, and keeps the conversation in localStorage. Plain
// JavaScript, no build step, nothing from another host (docs/design.md 5e).
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "flashnorm-mlx-chat";
const KEY_STORE = "flashnorm-mlx-key";
const SETTINGS = ["system", "temperature", "top_p", "max_tokens"];

let state = load();
let controller = null; // the reply being streamed: its AbortController

function load() {
  try {
    const s = JSON.parse(localStorage.getItem(STORE));
    if (s && Array.isArray(s.messages)) return { settings: {}, ...s };
  } catch (e) {} // a corrupt entry: start afresh
  return { messages: [], settings: {} };
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state));
}

function showError(text) {
  $("error").textContent = text || "";
  $("error").hidden = !text;
}

// --- the server -----------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEY_STORE);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// A fetch whose failures are one readable line: the server's own error
// message (OpenAI's body), a missing or wrong key, or a server that is gone.
async function api(path, body, signal) {
  let resp;
  try {
    const init = body === undefined
      ? { headers: headers() }
      : { method: "POST", headers: headers(), body: JSON.stringify(body), signal };
    resp = await fetch(path, init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new Error("cannot reach the server: is flashnorm-mlx serve still running?");
  }
  if (resp.status === 401) {
    const had = localStorage.getItem(KEY_STORE);
    localStorage.removeItem(KEY_STORE);
    askKey();
    throw new Error(had ? "wrong API key: enter it again" : "this server needs an API key");
  }
  if (!resp.ok) {
    let message = `the server answered ${resp.status}`;
    try {
      message = (await resp.json()).error.message;
    } catch (e) {}
    throw new Error(message);
  }
  return resp;
}

function askKey() {
  $("key-form").hidden = false;
  $("key").value = "";
  $("key").focus();
}

async function loadProps() {
  try {
    const p = await (await api("/props")).json();
    $("about").textContent = `${p.model} · ${p.mode} · ${p.engine} engine · ${p.device}`;
    const s = state.settings;
    if (s.temperature === undefined) s.temperature = p.temperature;
    if (s.top_p === undefined) s.top_p = p.top_p;
    if (s.max_tokens === undefined) s.max_tokens = Math.min(p.max_tokens, 512);
    showSettings();
    $("key-form").hidden = true;
    showError("");
  } catch (e) {
    $("about").textContent = "not connected";
    showError(e.message);
  }
}

// --- settings -------------------------------------------------------------------

function showSettings() {
  for (const name of SETTINGS) $(name).value = state.settings[name] ?? "";
}

function readSettings() {
  for (const name of SETTINGS) state.settings[name] = $(name).value;
  save();
}

function requestFields() {
  const s = state.settings;
  const out = {};
  for (const name of ["temperature", "top_p", "max_tokens"]) {
    // Sent as typed: the server says what is wrong with a bad value (a 400).
    if (s[name] !== "" && s[name] !== undefined) out[name] = Number(s[name]);
  }
  return out;
}

// --- the conversation -------------------------------------------------------------

function render() {
  $("messages").textContent = "";
  for (const m of state.messages) addMessage(m);
}

function addMessage(m) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  fill(div, m.content);
  $("messages").append(div);
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = m.stats || "";
  if (m.role === "assistant") $("messages").append(stats);
  div.scrollIntoView({ block: "end" });
  return { div, stats };
}

// Text, with ``` fenced blocks shown as code with a copy button.
function fill(div, text) {
  div.textContent = "";
  text.split("```").forEach((part, i) => {
    if (i % 2 === 0) {
      if (part) div.append(document.createTextNode(part));
      return;
    }
    const nl = part.indexOf("\n"); // the fence's first line names the language
    const code = nl >= 0 ? part.slice(nl + 1) : part;
    const pre = document.createElement("pre");
    const c = document.createElement("code");
    c.textContent = code;
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    copy.onclick = () => copyText(code).then(() => (copy.textContent = "Copied"));
    pre.append(copy, c);
    div.append(pre);
  });
}

async function copyText(text) {
  if (navigator.clipboard) return navigator.clipboard.writeText(text);
  const area = document.createElement("textarea"); // older browsers
  area.value = text;
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

function statsLine(usage, t) {
  const rate = (v) => (v === null || v === undefined ? "–" : v.toFixed(1));
  return (
    `${usage.completion_tokens} tokens · ${rate(t.generation_tokens_per_second)} tok/s decode` +
    ` · ${rate(t.prompt_tokens_per_second)} tok/s prompt (${usage.prompt_tokens} tokens)`
  );
}

// The server-sent events of a response, each parsed, until data: [DONE].
async function readEvents(resp, onEvent) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error("the reply stopped short: did the server stop?");
    buf += decoder.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function send() {
  const text = $("input").value;
  if (!text.trim() || controller) return;
  readSettings();
  showError("");
  $("input").value = "";
  const user = { role: "user", content: text };
  state.messages.push(user);
  addMessage(user);
  const history = state.messages.map(({ role, content }) => ({ role, content }));
  const system = state.settings.system;
  const body = {
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    stream: true,
    stream_options: { include_usage: true }, // usage comes in the last chunk
    ...requestFields(),
  };
  const reply = { role: "assistant", content: "", stats: "" };
  const view = addMessage(reply);
  let pieces = 0;
  controller = new AbortController();
  busy(true);
  try {
    const resp = await api("/v1/chat/completions", body, controller.signal);
    await readEvents(resp, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices && chunk.choices[0] ? chunk.choices[0].delta : null;
      if (delta && delta.content) {
        reply.content += delta.content;
        pieces += 1;
        fill(view.div, reply.content);
        view.div.scrollIntoView({ block: "end" });
      }
      if (chunk.usage && chunk.timings) reply.stats = statsLine(chunk.usage, chunk.timings);
    });
  } catch (e) {
    if (e.name === "AbortError") reply.stats = `stopped after ${pieces} token${pieces === 1 ? "" : "s"}`;
    else showError(e.message);
  } finally {
    controller = null;
    busy(false);
  }
  if (reply.content || reply.stats) {
    view.stats.textContent = reply.stats;
    state.messages.push(reply);
  } else {
    // Nothing came back (a 400, a wrong key, no server): the message goes
    // back into the box to send again.
    state.messages.pop();
    $("input").value = text;
    render();
  }
  save();
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  document.body.dataset.busy = on ? "1" : "";
}

// --- wiring ---------------------------------------------------------------------

$("compose").addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault(); // Enter sends; Shift+Enter is a new line
    send();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("new-chat").addEventListener("click", () => {
  if (controller) controller.abort();
  state.messages = [];
  save();
  render();
  showError("");
});
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  localStorage.setItem(KEY_STORE, $("key").value.trim());
  loadProps();
});
for (const name of SETTINGS) $(name).addEventListener("change", readSettings);

render();
showSettings();
loadProps();
