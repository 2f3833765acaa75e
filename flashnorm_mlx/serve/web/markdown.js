// A reply's Markdown as DOM nodes: headings, paragraphs, lists (nested by
// indent), tables, block quotes, rules, fenced code with a copy button, and
// inline code, bold, italic, strikethrough and links. Safe by construction:
// model text only ever becomes text nodes (textContent), never HTML, and a
// link keeps only an http(s) or mailto address. A fence not yet closed (a
// reply still streaming) shows as code so far.
"use strict";

const Markdown = (() => {
  const el = (tag, cls) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    return e;
  };

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const QUOTE = /^ {0,3}>\s?(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  function render(container, text, copy) {
    container.textContent = "";
    blocks(container, text.replace(/\r\n?/g, "\n").split("\n"), copy);
  }

  // Lines -> block nodes appended to `parent`.
  function blocks(parent, lines, copy) {
    let i = 0;
    let para = [];
    const flush = () => {
      if (!para.length) return;
      const p = el("p");
      inline(p, para.join("\n"));
      parent.append(p);
      para = [];
    };
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) {
        flush();
        i += 1;
      } else if ((m = FENCE.exec(line))) {
        flush();
        const close = new RegExp("^ {0,3}" + m[1][0] + "{" + m[1].length + ",}\\s*$");
        const body = [];
        i += 1;
        while (i < lines.length && !close.test(lines[i])) body.push(lines[i++]);
        i += 1; // the closing fence
        parent.append(codeBlock(body.join("\n") + (body.length ? "\n" : ""), m[2], copy));
      } else if ((m = HEADING.exec(line))) {
        flush();
        const h = el("h" + m[1].length);
        inline(h, m[2]);
        parent.append(h);
        i += 1;
      } else if (RULE.test(line) && !para.length) {
        parent.append(el("hr"));
        i += 1;
      } else if (QUOTE.test(line)) {
        flush();
        const inner = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
          inner.push(m[1]);
          i += 1;
        }
        const q = el("blockquote");
        blocks(q, inner, copy);
        parent.append(q);
      } else if (ITEM.test(line)) {
        flush();
        i = list(parent, lines, i, copy);
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("-")) {
        flush();
        i = table(parent, lines, i);
      } else {
        para.push(line);
        i += 1;
      }
    }
    flush();
  }

  // A list from lines[i]: items at its indent; deeper lines belong to the
  // item above (sub-lists, continued text). Returns the next line's index.
  function list(parent, lines, i, copy) {
    const first = ITEM.exec(lines[i]);
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const ul = el(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) ul.start = parseInt(first[2], 10);
    while (i < lines.length) {
      const m = ITEM.exec(lines[i]);
      if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
      const body = [m[3]];
      i += 1;
      // Deeper lines, and blank lines followed by deeper ones, are this item's.
      while (i < lines.length) {
        const line = lines[i];
        const deeper = line.trim() && line.search(/\S/) > indent;
        if (deeper) {
          body.push(line.slice(Math.min(line.search(/\S/), indent + 2)));
          i += 1;
        } else if (!line.trim() && i + 1 < lines.length && lines[i + 1].search(/\S/) > indent) {
          body.push("");
          i += 1;
        } else break;
      }
      const li = el("li");
      if (body.length === 1) inline(li, body[0]);
      else blocks(li, body, copy);
      ul.append(li);
      while (i < lines.length && !lines[i].trim() && i + 1 < lines.length) {
        const next = ITEM.exec(lines[i + 1]); // a blank line between items
        if (!next || next[1].length !== indent) break;
        i += 1;
      }
    }
    parent.append(ul);
    return i;
  }

  function cells(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  }

  function table(parent, lines, i) {
    const wrap = el("div", "table");
    const t = el("table");
    const head = cells(lines[i]);
    const align = cells(lines[i + 1]).map((c) =>
      c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : ""
    );
    const row = (values, tag) => {
      const tr = el("tr");
      head.forEach((_, k) => {
        const td = el(tag);
        if (align[k]) td.style.textAlign = align[k];
        inline(td, values[k] || "");
        tr.append(td);
      });
      return tr;
    };
    const thead = el("thead");
    thead.append(row(head, "th"));
    const tbody = el("tbody");
    i += 2;
    while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
      tbody.append(row(cells(lines[i]), "td"));
      i += 1;
    }
    t.append(thead, tbody);
    wrap.append(t);
    parent.append(wrap);
    return i;
  }

  function codeBlock(code, lang, copy) {
    const pre = el("pre");
    const c = el("code");
    c.textContent = code;
    if (lang) c.dataset.lang = lang;
    const button = el("button", "copy");
    button.type = "button";
    button.textContent = "Copy";
    button.onclick = () => copy(code).then(() => (button.textContent = "Copied"));
    pre.append(button, c);
    return pre;
  }

  const SAFE_URL = /^(https?:\/\/|mailto:)/i;
  const LINK = /^\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)/;
  const AUTOLINK = /^https?:\/\/[^\s<>()]+[^\s<>().,;:!?'"*_~]/;
  const PAIRS = [
    ["**", "strong"],
    ["__", "strong"],
    ["~~", "del"],
    ["*", "em"],
    ["_", "em"],
  ];

  // Inline Markdown of `text` appended to `parent`, as text nodes and elements.
  function inline(parent, text) {
    let plain = "";
    const out = () => {
      if (plain) parent.append(document.createTextNode(plain));
      plain = "";
    };
    let i = 0;
    outer: while (i < text.length) {
      const rest = text.slice(i);
      const ch = text[i];
      if (ch === "\\" && i + 1 < text.length && /[\\`*_{}[\]()#+\-.!|~<>]/.test(text[i + 1])) {
        plain += text[i + 1];
        i += 2;
        continue;
      }
      if (ch === "`") {
        const ticks = /^`+/.exec(rest)[0];
        const end = text.indexOf(ticks, i + ticks.length);
        if (end > 0) {
          out();
          const c = el("code");
          c.textContent = text.slice(i + ticks.length, end).replace(/^ (.*) $/, "$1");
          parent.append(c);
          i = end + ticks.length;
          continue;
        }
      }
      if (ch === "[") {
        const m = LINK.exec(rest);
        if (m) {
          out();
          if (SAFE_URL.test(m[2])) {
            const a = el("a");
            a.href = m[2];
            a.target = "_blank";
            a.rel = "noopener noreferrer";
            inline(a, m[1]);
            parent.append(a);
          } else inline(parent, m[1]); // any other scheme: the text alone
          i += m[0].length;
          continue;
        }
      }
      if (ch === "h" && (i === 0 || /\W/.test(text[i - 1]))) {
        const m = AUTOLINK.exec(rest);
        if (m) {
          out();
          const a = el("a");
          a.href = a.textContent = m[0];
          a.target = "_blank";
          a.rel = "noopener noreferrer";
          parent.append(a);
          i += m[0].length;
          continue;
        }
      }
      for (const [mark, tag] of PAIRS) {
        if (!rest.startsWith(mark)) continue;
        const inner = rest.slice(mark.length);
        // Opens before a non-space; "_" only at a word's start (snake_case stays).
        if (!inner || /^\s/.test(inner)) continue;
        if (mark[0] === "_" && i > 0 && /\w/.test(text[i - 1])) continue;
        let end = inner.indexOf(mark, 1);
        while (end > 0 && (/\s/.test(inner[end - 1]) || (mark.length === 1 && inner[end + 1] === mark))) {
          end = inner.indexOf(mark, end + (mark.length === 1 && inner[end + 1] === mark ? 2 : 1));
        }
        if (end <= 0) continue;
        if (mark[0] === "_" && /\w/.test(inner[end + mark.length] || "")) continue;
        out();
        const e = el(tag);
        inline(e, inner.slice(0, end));
        parent.append(e);
        i += mark.length * 2 + end;
        continue outer;
      }
      plain += ch;
      i += 1;
    }
    out();
  }

  return { render, inline };
})();
