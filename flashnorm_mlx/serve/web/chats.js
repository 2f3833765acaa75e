// The page's conversations, kept in localStorage, and their list in the side
// panel (open, rename, delete). One entry holds them all:
// {chats: [{id, title, messages, updated}], current: id, settings}.
"use strict";

const Chats = (() => {
  const STORE = "flashnorm-mlx-chat";

  const fresh = () => ({
    id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6),
    title: "",
    messages: [],
    updated: Date.now(),
  });

  function load() {
    let s = null;
    try {
      s = JSON.parse(localStorage.getItem(STORE));
    } catch (e) {} // a corrupt entry: start afresh
    if (s && Array.isArray(s.messages)) {
      // The page's first layout: one conversation, {messages, settings}.
      const chat = { ...fresh(), messages: s.messages };
      s = { chats: [chat], current: chat.id, settings: s.settings || {} };
    }
    if (!s || !Array.isArray(s.chats)) s = { chats: [], current: null, settings: {} };
    s.settings = s.settings || {};
    s.chats = s.chats.filter((c) => c && Array.isArray(c.messages));
    current(s);
    return s;
  }

  function save(s) {
    localStorage.setItem(STORE, JSON.stringify(s));
  }

  // The open conversation (a new one where there is none).
  function current(s) {
    let chat = s.chats.find((c) => c.id === s.current);
    if (!chat) {
      chat = s.chats[0] || fresh();
      if (!s.chats.includes(chat)) s.chats.unshift(chat);
      s.current = chat.id;
    }
    return chat;
  }

  // A new conversation, unless the open one is still empty.
  function create(s) {
    if (current(s).messages.length) {
      const chat = fresh();
      s.chats.unshift(chat);
      s.current = chat.id;
    }
    return current(s);
  }

  function remove(s, id) {
    s.chats = s.chats.filter((c) => c.id !== id);
    if (s.current === id) s.current = s.chats.length ? s.chats[0].id : null;
    return current(s);
  }

  function title(chat) {
    if (chat.title) return chat.title;
    const first = chat.messages.find((m) => m.role === "user");
    return first ? first.content.trim().split("\n")[0].slice(0, 48) : "New chat";
  }

  // The side panel's list; on.open(id), on.changed() after a rename or delete.
  function draw(s, list, on) {
    list.textContent = "";
    const sorted = [...s.chats].sort((a, b) => b.updated - a.updated);
    for (const chat of sorted) {
      const row = document.createElement("div");
      row.className = "chat" + (chat.id === s.current ? " current" : "");
      row.dataset.id = chat.id;
      const name = document.createElement("button");
      name.type = "button";
      name.className = "open";
      name.textContent = title(chat);
      name.title = title(chat);
      name.onclick = () => on.open(chat.id);
      const rename = button("✎", "rename", "Rename", () => startRename(row, chat, on));
      const del = button("✕", "delete", "Delete", () => {
        // A second click deletes; leaving the button takes the question back.
        if (del.dataset.sure) {
          const open = remove(s, chat.id);
          on.changed(open);
        } else {
          del.dataset.sure = "1";
          del.textContent = "Delete?";
        }
      });
      del.onblur = () => {
        delete del.dataset.sure;
        del.textContent = "✕";
      };
      row.append(name, rename, del);
      list.append(row);
    }
  }

  function startRename(row, chat, on) {
    const input = document.createElement("input");
    input.className = "rename-input";
    input.value = title(chat);
    input.setAttribute("aria-label", "Conversation name");
    row.textContent = "";
    row.append(input);
    input.focus();
    input.select();
    let done = false;
    const finish = (keep) => {
      if (done) return;
      done = true;
      if (keep && input.value.trim()) chat.title = input.value.trim().slice(0, 80);
      on.changed(null);
    };
    input.onkeydown = (e) => {
      if (e.key === "Enter") finish(true);
      if (e.key === "Escape") finish(false);
    };
    input.onblur = () => finish(true);
  }

  function button(text, cls, label, onclick) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = cls;
    b.textContent = text;
    b.title = label;
    b.setAttribute("aria-label", label);
    b.onclick = onclick;
    return b;
  }

  return { STORE, load, save, current, create, remove, title, draw, button };
})();
