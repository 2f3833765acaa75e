// flashnorm-mlx serve's chat page: streams replies from /v1/chat/completions
// (the server's own SSE stream) with their speed live, renders them as
// Markdown (markdown.js), keeps conversations in localStorage (chats.js), and
// times the last reply against the other mode on the same weights (POST
// /compare). Plain JavaScript, no build step, nothing from another host
// (docs/design.md 5e).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "flashnorm-mlx-key";
const SETTINGS = ["system", "temperature", "top_p", "max_tokens"];

let state = Chats.load();
let props = null; // GET /props: the model, its mode, what Compare runs against
let controller = null; // the reply being streamed: its AbortController

const save = () => Chats.save(state);
const chat = () => Chats.current(state);

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
    props = await (await api("/props")).json();
    $("about").textContent = `${props.model} · ${props.mode} · ${props.engine} engine · ${props.device}`;
    $("about").title = $("about").textContent;
    const s = state.settings;
    if (s.temperature === undefined) s.temperature = props.temperature;
    if (s.top_p === undefined) s.top_p = props.top_p;
    if (s.max_tokens === undefined) s.max_tokens = Math.min(props.max_tokens, 512);
    showSettings();
    $("key-form").hidden = true;
    showError("");
    render(); // Compare is offered once the server says against what
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

// The messages a reply at `end` answers (those before it), the system prompt first.
function history(c, end) {
  const msgs = c.messages.slice(0, end).map(({ role, content }) => ({ role, content }));
  const system = state.settings.system;
  return system ? [{ role: "system", content: system }, ...msgs] : msgs;
}

// --- the conversation -------------------------------------------------------------

function render() {
  $("messages").textContent = "";
  const c = chat();
  c.messages.forEach((m, i) => addMessage(m, i, c));
  drawChats();
}

function drawChats() {
  Chats.draw(state, $("chats"), {
    open: (id) => {
      if (controller) controller.abort();
      state.current = id;
      save();
      render();
      document.body.classList.remove("side-open");
    },
    changed: () => {
      save();
      render();
    },
  });
}

// One message's view: its text (a reply's as Markdown), and under a reply its
// speed line, a Compare line and its buttons; under a user message, Edit.
function addMessage(m, index, c) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  fill(div, m);
  $("messages").append(div);
  const view = { div };
  const last = index === c.messages.length - 1;
  if (m.role === "assistant") {
    view.stats = document.createElement("div");
    view.stats.className = "stats";
    view.stats.textContent = m.stats || "";
    view.compare = document.createElement("div");
    view.compare.className = "compare";
    view.compare.textContent = m.compare || "";
    const actions = document.createElement("div");
    actions.className = "actions";
    if (last) {
      actions.append(Chats.button("↻ Regenerate", "regenerate", "Regenerate this reply", regenerate));
      if (props && props.compare_with && (m.tokens || 0) >= 2) {
        const label = `Compare with ${props.compare_with}`;
        actions.append(Chats.button("⇄ " + label, "compare-btn", label, () => compare(index, view)));
      }
    }
    $("messages").append(view.stats, view.compare, actions);
  } else if (m.role === "user") {
    const actions = document.createElement("div");
    actions.className = "actions user-actions";
    actions.append(Chats.button("✎ Edit", "edit", "Edit and send again", () => edit(index, div, actions)));
    $("messages").append(actions);
  }
  div.scrollIntoView({ block: "end" });
  return view;
}

function fill(div, m) {
  if (m.role !== "assistant") {
    div.textContent = m.content;
    return;
  }
  const shown = div.querySelector("details.thought");
  Markdown.render(div, m.content, copyText);
  if (m.thought) div.prepend(thoughtView(m.thought, shown && shown.open));
}

// A thinking model's thought (docs/serve.md "Thinking models"): folded and
// dimmed above the answer, as text (never markup); kept open once opened.
function thoughtView(text, open) {
  const box = document.createElement("details");
  box.className = "thought";
  box.open = Boolean(open);
  const summary = document.createElement("summary");
  summary.textContent = "Thought";
  const body = document.createElement("div");
  body.textContent = text;
  box.append(summary, body);
  return box;
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

const rate = (v) => (v === null || v === undefined || !isFinite(v) ? "–" : v.toFixed(1));

// The finished reply's line: decode speed, and the prompt's, which counts only
// the tokens read now (those from the server's prompt cache shown apart).
function statsLine(usage, t, live) {
  const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
  const fresh = usage.prompt_tokens - cached;
  const prompt = cached ? `${cached} cached + ${fresh} new` : `${usage.prompt_tokens} tokens`;
  const decode = t ? t.generation_tokens_per_second : live;
  const promptRate = t ? ` at ${rate(t.prompt_tokens_per_second)} tok/s` : "";
  return `${usage.completion_tokens} tokens · ${rate(decode)} tok/s decode · prompt ${prompt}${promptRate}`;
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

// Streams a reply to chat c's messages into a new view; the reply joins c
// when anything came back. Returns whether it did.
async function generate(c) {
  const body = {
    messages: history(c, c.messages.length),
    stream: true,
    stream_options: { include_usage: true }, // usage comes in the last chunk
    ...requestFields(),
  };
  const reply = { role: "assistant", content: "", thought: "", stats: "" };
  const view = addMessage(reply, -1, c);
  view.stats.textContent = "reading the prompt…";
  view.stats.classList.add("live");
  let pieces = 0;
  let first = 0;
  let usage = null;
  let timings = null;
  const start = performance.now();
  controller = new AbortController();
  busy(true);
  try {
    const resp = await api("/v1/chat/completions", body, controller.signal);
    await readEvents(resp, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      if (chunk.timings) timings = chunk.timings;
      const delta = chunk.choices && chunk.choices[0] ? chunk.choices[0].delta : null;
      if (delta && (delta.content || delta.reasoning)) {
        const now = performance.now();
        reply.content += delta.content || "";
        reply.thought += delta.reasoning || "";
        pieces += 1;
        if (pieces === 1) first = now;
        fill(view.div, reply);
        // Live: pieces after the first over the time since it (the server's
        // decode figure, as its stream shows it); the first piece's wait.
        const tps = pieces > 1 ? (pieces - 1) / ((now - first) / 1000) : NaN;
        view.stats.textContent =
          `${pieces} tokens · ${rate(tps)} tok/s · first token after ${((first - start) / 1000).toFixed(1)} s`;
        view.div.scrollIntoView({ block: "end" });
      }
    });
    if (usage) {
      const live = pieces > 1 ? (pieces - 1) / ((performance.now() - first) / 1000) : NaN;
      reply.stats = statsLine(usage, timings, live);
      reply.tokens = usage.completion_tokens;
    }
  } catch (e) {
    if (e.name === "AbortError") reply.stats = `stopped after ${pieces} token${pieces === 1 ? "" : "s"}`;
    else showError(e.message);
  } finally {
    controller = null;
    busy(false);
  }
  view.stats.classList.remove("live");
  const got = Boolean(reply.content || reply.thought || reply.stats);
  if (got) {
    c.messages.push(reply);
    c.updated = Date.now();
  }
  save();
  if (c === chat()) render(); // the reply's buttons; another chat opened: its own
  return got;
}

async function send() {
  const text = $("input").value;
  if (!text.trim() || controller) return;
  readSettings();
  showError("");
  $("input").value = "";
  const c = chat();
  c.messages.push({ role: "user", content: text });
  c.updated = Date.now();
  save();
  render();
  if (!(await generate(c))) {
    // Nothing came back (a 400, a wrong key, no server): the message goes
    // back into the box to send again.
    c.messages.pop();
    $("input").value = text;
    save();
    render();
  }
}

// The last reply again, in its place; the old one back if nothing came.
async function regenerate() {
  const c = chat();
  if (controller || !c.messages.length || c.messages.at(-1).role !== "assistant") return;
  readSettings();
  showError("");
  const old = c.messages.pop();
  render();
  if (!(await generate(c))) {
    c.messages.push(old);
    save();
    render();
  }
}

// A user message edited in place: what followed it goes, a new reply comes.
function edit(index, div, actions) {
  if (controller) return;
  const c = chat();
  const box = document.createElement("textarea");
  box.className = "edit-box";
  box.value = c.messages[index].content;
  box.rows = Math.min(8, box.value.split("\n").length + 1);
  const ok = Chats.button("Send", "edit-send", "Send the edited message", async () => {
    const text = box.value;
    if (!text.trim() || controller) return;
    readSettings();
    showError("");
    c.messages = c.messages.slice(0, index);
    c.messages.push({ role: "user", content: text });
    c.updated = Date.now();
    save();
    render();
    await generate(c);
  });
  const cancel = Chats.button("Cancel", "edit-cancel", "Keep the message as it was", render);
  div.textContent = "";
  div.append(box);
  actions.textContent = "";
  actions.append(ok, cancel);
  box.focus();
}

// Compare: the reply at `index` regenerated on the other mode, same prompt,
// same token count; both decode speeds and FlashNorm's over stock's.
async function compare(index, view) {
  if (controller) return;
  const c = chat();
  const m = c.messages[index];
  readSettings();
  showError("");
  const other = props.compare_with;
  view.compare.textContent = `comparing with ${other}… (the first Compare builds the ${other} model)`;
  busy(true);
  controller = new AbortController();
  try {
    const body = { messages: history(c, index), max_tokens: m.tokens };
    const r = await (await api("/compare", body, controller.signal)).json();
    const speeds = r.modes.map((mode) => `${mode} ${rate(r.results[mode].decode_tokens_per_second)} tok/s`);
    m.compare =
      `decode: ${speeds.join(" · ")} · ${r.ratio.toFixed(2)}x flashnorm/stock ` +
      `(${r.tokens} tokens, same ${r.prompt_tokens}-token prompt and weights, greedy; ` +
      `${r.agree}/${r.tokens} tokens alike)`;
    save();
  } catch (e) {
    if (e.name !== "AbortError") showError(e.message);
  } finally {
    controller = null;
    busy(false);
  }
  view.compare.textContent = m.compare || "";
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
  Chats.create(state);
  save();
  render();
  showError("");
  document.body.classList.remove("side-open");
  $("input").focus();
});
$("menu").addEventListener("click", () => {
  // Wide screens: the panel is shown until closed; narrow ones: until opened.
  const narrow = matchMedia("(max-width: 700px)").matches;
  document.body.classList.toggle(narrow ? "side-open" : "side-closed");
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
