"""serve's chat page as a product (#45), in Debian's headless Chromium through
Playwright, on the embedded SmolLM2 (one server for the module):
- the tok/s figure moves while a 64-token reply streams; a follow-up shows its
  prompt as the server's cached + new tokens (the server's log says which);
- Markdown: a canned stream (Playwright's route) with a table, lists, a link,
  a javascript: link, inline code, a code block and <script>/<img onerror>
  renders the table and lists, shows the markup as text and runs nothing (a
  dialog handler records every alert); a real reply's list renders as a list;
- conversations: two survive a reload with their own messages, rename and
  delete; regenerate replaces the last reply; editing the first message drops
  what followed and the new reply is the API's greedy reply to it;
- Compare: two decode speeds and their ratio for the reply's own prompt, the
  other model mlx-lm's class, and stock's greedy tokens are the reply's;
- a phone (390x780): the header on one line, nothing wider than the screen;
  the favicon is served (no 404 on any request).
Screenshots at both sizes (docs/serve-chat.png after a Compare, 1000x640, and
docs/serve-chat-phone.png, 390x780) with FLASHNORM_MLX_SCREENSHOT=1, else to a
temporary folder, so that a test run leaves the checkout as it was."""

import json
import os
import re
import struct
from pathlib import Path

import pytest
from browser import REPLY_MS, chromium, sync_api
from serve_process import Server

PHONE = {"width": 390, "height": 780}
DESKTOP = {"width": 1000, "height": 640}
DOCS = Path(__file__).resolve().parent.parent / "docs"
SHOT, DESKTOP_SHOT = DOCS / "serve-chat-phone.png", DOCS / "serve-chat.png"
STORE = "flashnorm-mlx-chat"


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.kill()


def open_page(browser, server, size=DESKTOP, store=None):
    """(context, page, [(status, url)] of every response, [dialog messages])."""
    ctx = browser.new_context(viewport=size)
    page = ctx.new_page()
    seen, dialogs = [], []
    page.on("response", lambda r: seen.append((r.status, r.url)))
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    if store is not None:  # before the page's script reads it
        page.add_init_script(
            f"if (!sessionStorage.seeded) {{ sessionStorage.seeded = 1;"
            f" localStorage.setItem('{STORE}', {json.dumps(json.dumps(store))}); }}"
        )
    page.goto(server.url + "/")
    sync_api.expect(page.locator("#about")).to_contain_text("flashnorm", timeout=60_000)
    return ctx, page, seen, dialogs


def settings(page, temperature=0, max_tokens=8):
    if not page.locator("#temperature").is_visible():
        page.click("#settings summary")
    page.fill("#temperature", str(temperature))
    page.fill("#max_tokens", str(max_tokens))


def ask(page, text):
    """Send `text`; wait for its reply's final speed line."""
    n = page.locator(".msg.assistant").count()
    page.fill("#input", text)
    page.keyboard.press("Enter")
    wait_reply(page, n + 1)


def wait_reply(page, n):
    """Until the reply streaming ends (Send and Enter set busy at once); then
    the page holds `n` replies."""
    # A selector, not wait_for_function: the page's CSP forbids eval.
    page.wait_for_selector(
        "body:not([data-busy='1'])", state="attached", timeout=REPLY_MS
    )
    got = page.locator(".msg.assistant").count()
    assert got == n, (got, n, page.locator("#messages").inner_text())


def stored(page):
    return json.loads(page.evaluate(f"localStorage.getItem('{STORE}')"))


def current(page):
    s = stored(page)
    return next(c for c in s["chats"] if c["id"] == s["current"])["messages"]


def greedy(server, messages, n):
    status, api = server.request(
        "POST",
        "/v1/chat/completions",
        {"messages": messages, "temperature": 0, "max_tokens": n},
    )
    assert status == 200, api
    return api["choices"][0]["message"]["content"]


# --- live speed -----------------------------------------------------------------


# Every text the live speed line takes while a reply streams, in order.
WATCH = """() => {
  window.rates = [];
  new MutationObserver(() => {
    const s = document.querySelector('.stats.live');
    const m = s && /([\\d.]+) tok\\/s/.exec(s.textContent);
    if (m && window.rates[window.rates.length - 1] !== m[1]) window.rates.push(m[1]);
  }).observe(document.getElementById('messages'),
             {subtree: true, childList: true, characterData: true});
}"""


def test_speed_moves_while_streaming_and_cached_tokens_show_apart(browser, server):
    ctx, page, _, _ = open_page(browser, server)
    settings(page, 0, 16)  # 15 live figures at most, a tenth of a token/s apart
    page.evaluate(WATCH)
    ask(page, "Write a long story about a dragon and a knight.")
    rates = page.evaluate("window.rates")
    stats = page.locator(".stats").last.inner_text()
    print(rates, stats)
    assert len(rates) >= 4, rates  # a first figure, then 3 changes or more
    assert stats.startswith("16 tokens") and "tok/s decode" in stats, stats
    # A follow-up reads the cached conversation: only its new tokens count.
    settings(page, 0, 4)
    ask(page, "Thanks!")
    stats = page.locator(".stats").last.inner_text()
    line = [x for x in server.lines if " prompt " in x and "cached)" in x][-1]
    total, cached = map(
        int, re.search(r"prompt (\d+) tokens \((\d+) cached\)", line).groups()
    )
    print(stats, "|", line)
    assert cached > 0, line
    assert f"prompt {cached} cached + {total - cached} new at " in stats, (stats, line)
    ctx.close()


# --- Markdown -------------------------------------------------------------------

CANNED = (
    "# Fruit\n\nSome **bold**, *italic* and `x < y` code; see "
    "[the docs](https://example.com/a) or [this](javascript:alert(3)).\n\n"
    "- apple\n- pear\n  - green pear\n\n1. one\n2. two\n\n"
    "| name | count |\n|---|--:|\n| apple | 3 |\n| pear | 5 |\n\n"
    "<script>alert(1)</script> and <img src=x onerror=alert(2)>\n\n"
    "```js\nalert(4);\n```\n"
)


def sse(text: str, pieces: int = 12) -> str:
    """The server's stream shape for `text`, cut into `pieces` deltas."""
    step = -(-len(text) // pieces)
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    ]
    chunks += [
        {"choices": [{"index": 0, "delta": {"content": text[i : i + step]}}]}
        for i in range(0, len(text), step)
    ]
    chunks.append(
        {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {
                "prompt_tokens": 9,
                "completion_tokens": 42,
                "total_tokens": 51,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
            "timings": {
                "generation_tokens_per_second": 7.0,
                "prompt_tokens_per_second": 90.0,
            },
        }
    )
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_markdown_renders_and_model_text_never_runs(browser, server):
    ctx, page, _, dialogs = open_page(browser, server)
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, content_type="text/event-stream", body=sse(CANNED)
        ),
    )
    ask(page, "fruit?")
    msg = page.locator(".msg.assistant").last
    sync_api.expect(msg.locator("table tbody tr")).to_have_count(2)
    rows = msg.locator("table tr").all_inner_texts()
    print(rows)
    assert [r.split("\t") for r in rows] == [
        ["name", "count"],
        ["apple", "3"],
        ["pear", "5"],
    ]
    assert msg.locator("td").nth(1).evaluate("e => e.style.textAlign") == "right"
    assert msg.locator("ul > li").first.inner_text() == "apple"
    assert msg.locator("ul ul > li").inner_text() == "green pear"
    assert msg.locator("ol > li").all_inner_texts() == ["one", "two"]
    assert msg.locator("h1").inner_text() == "Fruit"
    assert (
        msg.locator("strong").inner_text() == "bold"
        and msg.locator("em").inner_text() == "italic"
    )
    assert msg.locator("p > code").inner_text() == "x < y"
    links = msg.locator("a")
    assert links.count() == 1 and links.get_attribute("href") == "https://example.com/a"
    assert msg.locator("pre code").inner_text() == "alert(4);\n"
    assert msg.locator("pre button.copy").count() == 1
    # The markup is text: no element made from it, nothing ran.
    text = msg.inner_text()
    assert (
        "<script>alert(1)</script>" in text and "<img src=x onerror=alert(2)>" in text
    )
    assert msg.locator("script, img, iframe").count() == 0
    page.reload()  # and once more from storage
    sync_api.expect(page.locator(".msg.assistant table")).to_have_count(1)
    page.click(".msg.assistant a")  # a link opens a tab, runs nothing here
    assert dialogs == [], dialogs
    ctx.close()


def test_a_real_reply_s_list_renders_as_a_list(browser, server):
    ctx, page, _, dialogs = open_page(browser, server)
    settings(page, 0, 40)
    q = "List three fruits as a Markdown list, nothing else."
    ask(page, q)
    want = greedy(server, [{"role": "user", "content": q}], 40)
    item = re.compile(r"^(?:[-*+]|\d+[.)])\s+(.*)$")
    items = [m.group(1).strip() for x in want.splitlines() if (m := item.match(x))]
    print(repr(want), items)
    assert len(items) >= 2, want  # the reference reply is a list
    got = page.locator(".msg.assistant").last.locator("li").all_inner_texts()
    assert [x.strip() for x in got][: len(items)] == [
        re.sub(r"\*\*", "", x) for x in items
    ]
    assert dialogs == []
    ctx.close()


# --- conversations --------------------------------------------------------------


def titles(page):
    return page.locator("#chats .chat button.open").all_inner_texts()


def test_conversations_regenerate_and_edit(browser, server):
    ctx, page, _, _ = open_page(browser, server)
    page.click("#new-chat")
    settings(page, 0, 3)
    ask(page, "Hi there")
    ask(page, "Name a color.")
    first = current(page)
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    ask(page, "What is 2+2?")
    second = current(page)
    page.reload()
    sync_api.expect(page.locator("#chats .chat")).to_have_count(2)
    assert titles(page)[:2] == ["What is 2+2?", "Hi there"], titles(page)
    # Each reopens with its own messages.
    for title, msgs in (("Hi there", first), ("What is 2+2?", second)):
        page.locator("#chats button.open", has_text=title).click()
        sync_api.expect(page.locator(".msg")).to_have_count(len(msgs))
        shown = page.locator(".msg.user").all_inner_texts()
        assert shown == [m["content"] for m in msgs if m["role"] == "user"], shown
    # Regenerate: the last reply replaced, now 6 tokens long where it was 3.
    assert current(page)[-1]["tokens"] == 3
    settings(page, 0, 6)
    page.click(".actions button.regenerate")
    wait_reply(page, 1)
    assert page.locator(".stats").inner_text().startswith("6 tokens")
    after = current(page)
    print(second, after)
    assert len(after) == 2 and after[0] == second[0] and after[1]["tokens"] == 6
    assert after[1]["content"] == greedy(server, [second[0]], 6)
    # Edit the first message of the other chat: what followed goes.
    page.locator("#chats button.open", has_text="Hi there").click()
    sync_api.expect(page.locator(".msg")).to_have_count(4)
    page.locator(".user-actions button.edit").first.click()
    page.fill(".edit-box", "Name a fruit.")
    page.click("button.edit-send")
    wait_reply(page, 1)
    edited = current(page)
    print(edited)
    assert [m["role"] for m in edited] == ["user", "assistant"]
    assert edited[0]["content"] == "Name a fruit."
    assert edited[1]["content"] == greedy(server, [edited[0]], 6)
    # Rename one, delete the other; both kept over a reload.
    row = page.locator("#chats .chat", has_text="What is 2+2?")
    row.locator("button.rename").click()
    page.fill(".rename-input", "Sums")
    page.keyboard.press("Enter")
    sync_api.expect(page.locator("#chats button.open", has_text="Sums")).to_have_count(
        1
    )
    page.locator("#chats .chat", has_text="Name a fruit.").locator(
        "button.delete"
    ).click()
    page.locator("#chats .chat", has_text="Name a fruit.").locator(
        "button.delete"
    ).click()
    page.reload()
    sync_api.expect(page.locator("#chats .chat")).to_have_count(1)
    assert titles(page) == ["Sums"]
    assert current(page) == after
    ctx.close()


# --- Compare --------------------------------------------------------------------


def test_compare_shows_both_speeds_and_their_ratio(browser, server, tmp_path):
    ctx, page, _, _ = open_page(browser, server, DESKTOP, WIDE)  # earlier chats
    page.click("#new-chat")
    settings(page, 0, 8)
    # A short system message: both models prefill the prompt again, and
    # SmolLM2's default system message is ~14 tokens more.
    page.fill("#system", "You tell stories.")
    q = "Tell me a story about a cat."  # longer than 8 tokens: no end-of-sequence
    with page.expect_request("**/v1/chat/completions") as chat_req:
        ask(page, q)
    reply = current(page)[-1]
    assert reply["tokens"] == 8, reply
    with page.expect_response("**/compare", timeout=REPLY_MS) as resp:
        page.click("button.compare-btn")
    r = resp.value.json()
    sent = json.loads(resp.value.request.post_data)
    print(json.dumps(r)[:800])
    # The reply's own prompt and length.
    assert sent["messages"] == json.loads(chat_req.value.post_data)["messages"]
    assert sent["messages"][0] == {"role": "system", "content": "You tell stories."}
    assert sent["max_tokens"] == 8 and r["tokens"] == 8
    fn, st = (
        r["results"][m]["decode_tokens_per_second"] for m in ("flashnorm", "stock")
    )
    assert fn > 0 and st > 0 and r["ratio"] == pytest.approx(fn / st, abs=2e-3)
    line = page.locator(".compare").last
    sync_api.expect(line).to_contain_text("flashnorm/stock")
    text = line.inner_text()
    print(text)
    assert f"flashnorm {fn:.1f} tok/s" in text and f"stock {st:.1f} tok/s" in text
    assert f"{r['ratio']:.2f}x" in text
    # The other model is mlx-lm's own class; on the same weights, greedy, it
    # says what the served model said.
    assert r["results"]["stock"]["model"].startswith("mlx_lm.models."), r
    assert r["results"]["flashnorm"]["model"].startswith("flashnorm_mlx."), r
    ids = r["results"]["stock"]["token_ids"]
    status, text_back = server.request("POST", "/detokenize", {"tokens": ids})
    assert status == 200 and text_back["prompt"] == reply["content"], text_back
    assert r["agree"] == 8
    shot = (
        DESKTOP_SHOT
        if os.environ.get("FLASHNORM_MLX_SCREENSHOT") == "1"
        else tmp_path / "d.png"
    )
    page.click("#settings summary")  # closed, as a user keeps it
    page.screenshot(path=str(shot))
    assert struct.unpack(">II", shot.read_bytes()[16:24]) == (1000, 640)
    page.reload()  # kept with the reply
    sync_api.expect(page.locator(".compare").last).to_have_text(text)
    ctx.close()


def test_compare_refuses_a_bad_count_in_one_line(server):
    msgs = [{"role": "user", "content": "hi"}]
    for bad in (None, 1, "8", True):
        body = {"messages": msgs, **({} if bad is None else {"max_tokens": bad})}
        status, r = server.request("POST", "/compare", body)
        print(bad, status, r)
        assert status == 400 and r["error"]["param"] == "max_tokens", r
    status, r = server.request("POST", "/compare", {"max_tokens": 4})
    assert status == 400 and r["error"]["param"] == "messages", r
    status, r = server.request("GET", "/compare")
    assert status == 405, r


# --- a phone --------------------------------------------------------------------

FRUIT = (
    "Here are two fruits side by side:\n\n"
    "| Fruit | Color | Taste | Season | Grown first in | kcal per 100 g |\n"
    "|---|---|---|---|---|--:|\n"
    "| Apple | red | sweet | autumn | Central Asia | 52 |\n"
    "| Lemon | yellow | sour | winter | South Asia | 29 |\n\n"
    "- **Apple**: crisp, keeps for months\n- **Lemon**: juice for `lemonade`\n\n"
    "```python\nfruits = {'apple': 52, 'lemon': 29}  # kcal per 100 g, from the table above\n```\n"
    "Source: https://example.com/fruit/a-very-long-address-that-does-not-fit-on-a-phone-screen"
)
WIDE = {
    "chats": [
        {
            "id": "fruit",
            "title": "",
            "updated": 2,
            "messages": [
                {"role": "user", "content": "Compare an apple and a lemon in a table."},
                {
                    "role": "assistant",
                    "content": FRUIT,
                    "stats": "96 tokens · 5.1 tok/s decode · prompt 12 cached + 9 new at 30.2 tok/s",
                    "tokens": 96,
                },
            ],
        },
        {"id": "old", "title": "Haiku about the sea", "updated": 1, "messages": []},
    ],
    "current": "fruit",
    "settings": {},
}

OVERFLOW = """() => {
  const w = window.innerWidth, bad = [];
  for (const e of document.querySelectorAll('body *')) {
    if (e.closest('pre, .table') && !e.matches('pre, .table')) continue;  // they scroll
    const r = e.getBoundingClientRect();
    if (r.width && r.right > w + 0.5) bad.push(e.tagName + '.' + e.className + ' ' + r.right);
  }
  return {scroll: document.documentElement.scrollWidth, width: w, bad};
}"""


def test_phone_header_one_line_no_overflow_and_favicon(browser, server, tmp_path):
    ctx, page, seen, _ = open_page(browser, server, PHONE, WIDE)
    sync_api.expect(page.locator(".msg.assistant table")).to_have_count(1)
    header = page.evaluate(
        "() => [...document.querySelector('header').children]"
        ".filter(e => e.offsetWidth).map(e => e.getBoundingClientRect())"
        ".map(r => [r.top, r.bottom])"
    )
    print(header)
    tops = [t for t, _ in header]
    assert len(header) == 4 and max(tops) - min(tops) < 12, header  # one line
    assert max(b for _, b in header) - min(tops) < 40, header
    o = page.evaluate(OVERFLOW)
    print(o)
    assert o["scroll"] <= o["width"] and not o["bad"], o
    shot = (
        SHOT
        if os.environ.get("FLASHNORM_MLX_SCREENSHOT") == "1"
        else tmp_path / SHOT.name
    )
    page.screenshot(path=str(shot))
    assert struct.unpack(">II", shot.read_bytes()[16:24]) == (390, 780)
    # The conversations open over the chat, and close on a choice.
    assert not page.locator("#side").is_visible()
    page.click("#menu")
    sync_api.expect(page.locator("#chats .chat")).to_have_count(2)
    o = page.evaluate(OVERFLOW)
    assert o["scroll"] <= o["width"] and not o["bad"], o
    page.click("#chats button.open >> nth=0")
    sync_api.expect(page.locator("#side")).to_be_hidden()
    # The favicon, and no request of the page's answered 4xx/5xx.
    icon = page.evaluate("document.querySelector('link[rel=icon]').href")
    status, body = server.request("GET", "/favicon.ico")
    print(seen, status)
    assert status == 200 and "<svg" in body
    assert any(u == icon and s == 200 for s, u in seen), seen
    assert all(s < 400 for s, _ in seen), seen
    ctx.close()


def test_a_thought_shows_folded_apart_from_the_answer(browser, server):
    """A thinking model's stream (delta.reasoning, then content, as serve
    sends it, test_serve_thinking): the thought folded above the answer, as
    text, and the answer alone as the reply."""
    ctx, page, _, _ = open_page(browser, server)
    thought = {
        "choices": [{"index": 0, "delta": {"reasoning": "Let me <b>think</b>."}}]
    }
    body = sse("The answer.", pieces=2).replace(
        "data: ", f"data: {json.dumps(thought)}\n\ndata: ", 1
    )
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, content_type="text/event-stream", body=body
        ),
    )
    ask(page, "think?")
    msg = page.locator(".msg.assistant").last
    box = msg.locator("details.thought")
    assert box.count() == 1 and not box.evaluate("e => e.open"), msg.inner_html()
    # Folded: its text is in the page (escaped, not markup) but not rendered.
    thought = box.locator("div").text_content()
    assert thought == "Let me <b>think</b>.", msg.inner_html()
    assert box.locator("div b").count() == 0, msg.inner_html()
    box.locator("summary").click()  # unfolded, it shows
    assert box.locator("div").inner_text() == "Let me <b>think</b>.", msg.inner_html()
    assert msg.locator("p").last.inner_text() == "The answer.", msg.inner_html()
    ctx.close()
