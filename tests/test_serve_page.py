"""serve's chat page (GET /, #39) in a real browser: Debian's headless
Chromium driven by Playwright. On the embedded SmolLM2: a typed message
streams back the API's own greedy reply (the reference: the same messages
through /v1/chat/completions), with its tok/s line; Stop ends a long reply
early and the server logs the cancel; a reload finds the conversation; code
blocks get a copy button; nothing is loaded from another host. On a tiny
model with an API key: the key is asked for once, a wrong one, a bad setting
(a 400) and a stopped server each show one visible line. The finished reply's
screenshot, at a fixed size, is checked (docs/serve-chat.png is
test_serve_page_chat's, after a Compare)."""

import json
import signal
import struct
import time

import pytest
import tiny
from browser import REPLY_MS, chromium, sync_api
from serve_process import Server

from flashnorm_mlx.serve import API_KEY_ENV

SIZE = {"width": 1000, "height": 640}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


def open_page(browser, url):
    """(context, page, every URL the page requested)."""
    ctx = browser.new_context(viewport=SIZE)
    ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin=url)
    page = ctx.new_page()
    urls = []
    page.on("request", lambda r: urls.append(r.url))
    page.goto(url + "/")
    return ctx, page, urls


def stored(page) -> list:
    """The open conversation's messages (chats.js keeps them all in one entry)."""
    s = json.loads(page.evaluate("localStorage.getItem('flashnorm-mlx-chat')"))
    return next(c for c in s["chats"] if c["id"] == s["current"])["messages"]


def wait_for_line(server, words, timeout=60):
    """Until the server's stderr has a line with `words` (a mark, not a sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(words in line for line in server.lines):
            return
        time.sleep(0.05)
    pytest.fail(f"no {words!r} in the server log:\n{server.log()}")


# --- the embedded model ------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.kill()


def test_page_streams_the_greedy_reply_and_keeps_it(browser, server, tmp_path):
    ctx, page, urls = open_page(browser, server.url)
    about = page.locator("#about")
    sync_api.expect(about).to_contain_text("flashnorm", timeout=30_000)
    print(about.inner_text())
    assert "SmolLM2" in about.inner_text() and "engine" in about.inner_text()
    page.click("#settings summary")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "12")
    # Shift+Enter is a new line, not a send.
    page.click("#input")
    page.keyboard.type("first line")
    page.keyboard.press("Shift+Enter")
    assert page.input_value("#input") == "first line\n"
    assert page.locator(".msg.user").count() == 0
    page.fill("#input", QUESTION)
    page.keyboard.press("Enter")
    stats = page.locator(".stats").first
    sync_api.expect(stats).to_contain_text("tok/s decode", timeout=REPLY_MS)
    print(stats.inner_text())
    reply = stored(page)[-1]["content"]
    status, api = server.request(
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0,
            "max_tokens": 12,
        },
    )
    assert status == 200, api
    want = api["choices"][0]["message"]["content"]
    assert reply == want and "Paris" in reply, (reply, want)
    assert page.locator(".msg.assistant").inner_text().strip() == want.strip()
    assert f"{api['usage']['completion_tokens']} tokens" in stats.inner_text()
    shot = tmp_path / "serve-chat.png"
    page.screenshot(path=str(shot))
    png = shot.read_bytes()  # the IHDR chunk: width and height, big-endian
    assert struct.unpack(">II", png[16:24]) == (SIZE["width"], SIZE["height"])
    # A reload finds the conversation, and its speed line.
    page.reload()
    sync_api.expect(page.locator(".msg.assistant")).to_have_text(want.strip())
    sync_api.expect(page.locator(".msg.user")).to_have_text(QUESTION)
    sync_api.expect(page.locator(".stats").first).to_contain_text("tok/s decode")
    others = [u for u in urls if not u.startswith(server.url + "/")]
    assert not others, others  # nothing from another host
    ctx.close()


def test_stop_ends_a_long_reply_and_the_server_cancels(browser, server):
    ctx, page, _ = open_page(browser, server.url)
    sync_api.expect(page.locator("#about")).to_contain_text("flashnorm")
    page.click("#new-chat")
    page.click("#settings summary")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "400")
    page.fill("#input", "Write a long story about a dragon and a knight.")
    page.keyboard.press("Enter")
    # A locator, not wait_for_function: the page's CSP forbids eval.
    sync_api.expect(page.locator(".msg.assistant").first).not_to_be_empty(
        timeout=REPLY_MS
    )
    page.click("#stop")
    stats = page.locator(".stats").first
    sync_api.expect(stats).to_contain_text("stopped after")
    wait_for_line(server, "cancelled: the client left")
    print(stats.inner_text(), [x for x in server.lines if "cancelled" in x])
    n = int(stats.inner_text().split("stopped after ")[1].split()[0])
    assert 1 <= n < 400, n
    assert page.locator("#send").is_visible() and not page.locator("#stop").is_visible()
    ctx.close()


def test_code_blocks_have_a_copy_button(browser, server):
    ctx, page, _ = open_page(browser, server.url)
    # The page's first storage layout ({messages, settings}): read as one chat.
    chat = {
        "messages": [
            {"role": "user", "content": "code?"},
            {"role": "assistant", "content": "Here:\n```python\nprint(1)\n```\ndone"},
        ],
        "settings": {},
    }
    page.evaluate(
        f"localStorage.setItem('flashnorm-mlx-chat', {json.dumps(json.dumps(chat))})"
    )
    page.reload()
    code = page.locator(".msg.assistant pre code")
    sync_api.expect(code).to_have_text("print(1)\n")
    page.click(".msg.assistant pre button.copy")
    sync_api.expect(page.locator("button.copy")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == "print(1)\n"
    ctx.close()


# --- a tiny model behind an API key ------------------------------------------------

KEY = "page-test-key"


def test_key_prompt_bad_setting_and_stopped_server(browser, tmp_path):
    model = tiny.make_llama(tmp_path / "tiny", "gqa_untied")
    s = Server(str(model), env={API_KEY_ENV: KEY}, api_key=KEY)
    try:
        ctx, page, _ = open_page(browser, s.url)
        error = page.locator("#error")
        sync_api.expect(page.locator("#key-form")).to_be_visible()
        sync_api.expect(error).to_have_text("this server needs an API key")
        page.fill("#key", "wrong")
        page.click("#key-form button")
        sync_api.expect(error).to_have_text("wrong API key: enter it again")
        page.fill("#key", KEY)
        page.click("#key-form button")
        sync_api.expect(page.locator("#about")).to_contain_text("flashnorm")
        sync_api.expect(page.locator("#key-form")).to_be_hidden()
        sync_api.expect(error).to_be_hidden()
        # The key is asked for once: a reload connects with it.
        page.reload()
        sync_api.expect(page.locator("#about")).to_contain_text("flashnorm")
        sync_api.expect(page.locator("#key-form")).to_be_hidden()
        # A bad setting: the server's 400, one line; the message back in the box.
        page.click("#settings summary")
        page.fill("#temperature", "-1")  # below mlx-lm's floor (limits.py)
        page.fill("#input", "hello")
        page.keyboard.press("Enter")
        sync_api.expect(error).to_contain_text("'temperature' must be")
        assert page.input_value("#input") == "hello"
        assert page.locator(".msg").count() == 0
        # The server stopped: one line, not a blank page.
        page.fill("#temperature", "0")
        assert s.stop(signal.SIGTERM) == 0
        page.click("#send")
        sync_api.expect(error).to_have_text(
            "cannot reach the server: is flashnorm-mlx serve still running?"
        )
        ctx.close()
    finally:
        s.kill()
