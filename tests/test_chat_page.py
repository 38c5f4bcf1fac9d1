"""The chat page (`GET /`, freetoken/serve/static/chat.html) in a real browser: headless chromium, driven by selenium,
against a live `freetoken serve` (the bundled model on the cpu device, with an API key).

The browser is Debian's chromium and chromium-driver (scripts/setup --test-oracles installs them); without them, or
without selenium, the browser tests skip locally and fail in CI. A screenshot of the page after a two-turn chat goes
to $FREETOKEN_TEST_ARTIFACTS (default: .artifacts/ in the checkout).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
from live_server import KEY, running_server

from freetoken.testing.oracles import need, need_program

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 120  # a reply on the cpu device of a loaded 2-core machine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(tmp_path_factory)


@pytest.fixture(scope="module")
def browser():
    need("selenium", "the chat page's browser test (pip install selenium: a dev extra)")
    why = "the chat page's browser test (Debian: apt-get install chromium chromium-driver)"
    need_program(CHROMIUM, why)
    need_program(CHROMEDRIVER, why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture
def page(server, browser):
    """The chat page, freshly loaded with nothing saved in the browser."""
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(server.url + "/")
    return browser


def _wait(driver, until, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(lambda d: until(d), message=what)


def _el(driver, css: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, css)


def _all(driver, css: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def _fill(driver, css: str, text: str):
    el = _el(driver, css)
    el.clear()
    el.send_keys(text)


def _finished_replies(driver, n: int):
    """Wait until ``n`` assistant replies show their stats line; the replies."""
    _wait(driver, lambda d: len([s for s in _all(d, ".message.assistant .stats") if "tok/s" in s.text]) >= n,
          f"{n} assistant replies with their tok/s stats (error shown: {_el(driver, '#error').text!r})")
    return _all(driver, ".message.assistant")


def _artifacts() -> Path:
    out = Path(os.environ.get("FREETOKEN_TEST_ARTIFACTS") or ROOT / ".artifacts")
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_page_is_served_without_a_key(server):
    r = httpx.get(server.url + "/")  # a browser navigating cannot send the key
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for hook in ('id="input"', 'id="send"', 'id="stop"', 'id="messages"', 'id="api-key"', 'id="error"'):
        assert hook in r.text
    # one self-contained file: nothing loaded from elsewhere (it works offline), and the browser is told so
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", r.text, re.I)
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert httpx.get(server.url + "/v1/models").status_code == 401  # what the page calls still wants the key
    assert server.metric("freetoken_requests_total", '{endpoint="/",status="200"}') >= 1


def test_chat_streams_two_turns_with_stats(page):
    from selenium.webdriver.common.keys import Keys

    _fill(page, "#api-key", KEY)
    _fill(page, "#temperature", "0")
    _fill(page, "#max-tokens", "24")
    box = _el(page, "#input")
    box.send_keys("def add(a, b):", Keys.ENTER)  # Enter sends
    first = _finished_replies(page, 1)[0]
    text = first.find_element("css selector", ".content").text
    assert text.strip()
    assert int(first.get_attribute("data-chunks")) > 1  # the text came in pieces, rendered as they came
    stats = first.find_element("css selector", ".stats").text
    assert re.search(r"[\d.]+ tok/s · prompt [\d.]+ tok/s · first token [\d.]+ s · expert cache hits ([\d.]+%|n/a)",
                     stats), stats
    m = re.search(r"(\d+) prompt.* \+ (\d+) completion tokens", stats)
    assert m and 1 <= int(m.group(2)) <= 24, stats
    assert "freetoken-default" in _el(page, "#model").text
    assert page.execute_script("return localStorage.getItem('freetoken.apiKey')") == KEY

    box.send_keys("x = 1", Keys.SHIFT, Keys.ENTER, Keys.NULL, "y")  # Shift+Enter: a new line, nothing sent
    assert box.get_attribute("value") == "x = 1\ny" and len(_all(page, ".message.user")) == 1
    _el(page, "#send").click()
    replies = _finished_replies(page, 2)
    assert len(replies) == 2 and len(_all(page, ".message.user")) == 2
    assert replies[1].find_element("css selector", ".content").text.strip()
    # the whole conversation went with the second turn: its prompt holds the first turn and its reply
    m2 = re.search(r"(\d+) prompt", replies[1].find_element("css selector", ".stats").text)
    assert int(m2.group(1)) > int(m.group(1)) + 1
    assert _el(page, "#error").text == ""

    shot = _artifacts() / "chat_page.png"
    page.save_screenshot(str(shot))
    assert shot.exists() and shot.stat().st_size > 10_000

    _el(page, "#new-chat").click()
    assert _all(page, ".message") == []


def test_stop_aborts_the_stream(server, page):
    cancelled = server.metric("freetoken_requests_cancelled_total")
    _fill(page, "#api-key", KEY)
    _fill(page, "#temperature", "0")
    _fill(page, "#max-tokens", "400")
    _fill(page, "#input", "class Tree:")
    _el(page, "#send").click()
    _wait(page, lambda d: int(_el(d, ".message.assistant").get_attribute("data-chunks")) >= 2, "two chunks")
    _el(page, "#stop").click()
    _wait(page, lambda d: _all(d, ".message.assistant .stats"), "the stats line of the stopped reply")
    stats = _el(page, ".message.assistant .stats").text
    if "tok/s" in stats:
        pytest.skip(f"the reply finished before Stop was clicked: {stats}")
    assert stats.startswith("stopped after")
    assert _el(page, "#send").is_enabled() and not _el(page, "#stop").is_enabled()
    assert _el(page, "#error").text == ""
    # the browser closed the connection: the server cancels the generation
    _wait(page, lambda d: server.metric("freetoken_requests_cancelled_total") == cancelled + 1,
          "the server counting the generation as cancelled")


def test_wrong_key_shows_the_server_error(page):
    from selenium.webdriver.common.keys import Keys

    _fill(page, "#api-key", "not-the-key")
    _el(page, "#input").send_keys("hello", Keys.ENTER)
    _wait(page, lambda d: _el(d, "#error").text, "an error shown in #error")
    assert "401" in _el(page, "#error").text and "Incorrect or missing API key" in _el(page, "#error").text
    assert _all(page, ".message") == []  # the failed turn is taken back ...
    assert _el(page, "#input").get_attribute("value") == "hello"  # ... and its text is there to send again


def test_markdown_is_rendered_safely(page):
    source = ("Here is `add` and <img src=x onerror=alert(1)>:\n\n```python\ndef add(a, b):\n    return a + b  # <b>&\n"
              "```\nline one\nline two\n\n```\n<script>alert(2)</script>")  # the last block is unclosed: streaming
    html = page.execute_script("return window.renderMarkdown(arguments[0])", source)
    assert "<img" not in html and "<script" not in html and "<b>" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html and "<code>add</code>" in html
    assert '<div class="lang">python</div>' in html and "<p>line one<br>line two</p>" in html
    # put into the page, it is exactly the text: two code blocks, no element the text asked for
    blocks = page.execute_script("""
        const div = document.createElement("div");
        div.innerHTML = window.renderMarkdown(arguments[0]);
        document.body.appendChild(div);
        const out = {imgs: div.querySelectorAll("img, script, b").length,
                     code: [...div.querySelectorAll("pre > code")].map(c => c.textContent)};
        div.remove();
        return out;""", source)
    assert blocks == {"imgs": 0, "code": ["def add(a, b):\n    return a + b  # <b>&", "<script>alert(2)</script>"]}
