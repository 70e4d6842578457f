"""The chat page at / in a real headless Chromium (the system's, driven by Playwright), against a
real server under --root-path with an API key: tokens arrive one by one, stop ends the stream."""

from __future__ import annotations

import shutil
import urllib.request

import orjson
import pytest
from test_server_support import ServerProcess, tiny_server_args

playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium", path="/usr/bin")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)"
)

PREFIX = "/chat"
API_KEY = "page-secret"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# the chunks the reply had at each of its renders, recorded by the page itself
RECORD_RENDERS = """() => {
  window.renders = [];
  new MutationObserver(() => {
    const reply = document.querySelector(".message.assistant");
    if (reply && reply.dataset.chunks) window.renders.push(Number(reply.dataset.chunks));
  }).observe(document.getElementById("log"), {subtree: true, attributeFilter: ["data-chunks"]});
}"""


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    extra = ("--root-path", PREFIX, "--api-key", API_KEY, "--served-model-name", "tiny-chat")
    process = ServerProcess(log, *tiny_server_args(tiny_model_dir, *extra))
    warm_up(process.start())
    yield process
    process.stop()


def warm_up(server: ServerProcess) -> None:
    """A first request, so the page's does not wait for the first step's warm-up."""
    body = orjson.dumps({"prompt": "x", "max_tokens": 2})
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    request = urllib.request.Request(f"{server.url}/v1/completions", body, headers)
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.status == 200


@pytest.fixture(scope="module")
def browser_page(server, tmp_path_factory):
    profile = tmp_path_factory.mktemp("chromium-profile")  # new and empty
    with playwright.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        context.set_default_timeout(90_000)  # two cores shared with the rest of the suite
        page = context.new_page()
        page.requested = []
        page.on("request", lambda request: page.requested.append(request.url))
        page.on("console", lambda message: print("console:", message.text))
        page.goto(f"{server.url}{PREFIX}/")
        yield page
        context.close()


def sign_in(page) -> None:
    page.wait_for_selector("#key-row", state="visible")
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("() => document.getElementById('model').textContent === 'tiny-chat'")


def test_the_page_asks_for_the_key_then_streams_and_stops(browser_page, server, tmp_path):
    page = browser_page
    sign_in(page)
    page.evaluate(RECORD_RENDERS)
    page.fill("#max-tokens", "400")
    page.fill("#temperature", "1")  # greedy, the tiny model says only newlines
    page.fill("#prompt", "Tell me a long story.")
    page.click("#send")
    page.wait_for_function(
        "() => document.querySelector('.message.assistant')?.dataset.chunks >= 8"
    )
    assert page.is_enabled("#stop") and page.is_disabled("#send")
    page.click("#stop")
    page.wait_for_selector(".message.assistant[data-done=stopped]")
    chunks = int(page.get_attribute(".message.assistant", "data-chunks"))
    page.wait_for_timeout(500)
    assert int(page.get_attribute(".message.assistant", "data-chunks")) == chunks  # it ended
    assert 8 <= chunks < 400 and page.is_enabled("#send") and page.is_disabled("#stop")
    renders = page.evaluate("window.renders")
    assert len(set(renders)) >= 8 and renders == sorted(renders)  # token by token, not at once
    assert page.text_content(".message.assistant .content").strip()
    page.screenshot(path=str(tmp_path / "chat-page.png"), full_page=True)
    assert (tmp_path / "chat-page.png").stat().st_size > 10_000
    assert all(url.startswith(server.url) for url in page.requested)  # nothing from elsewhere


def test_errors_are_shown(browser_page) -> None:
    page = browser_page
    page.fill("#max-tokens", "100000")
    page.fill("#prompt", "Again.")
    page.click("#send")
    page.wait_for_selector("#error", state="visible")
    assert "maximum context length" in page.text_content("#error")
    assert page.is_enabled("#send")


def test_markdown_and_code_blocks_are_rendered(browser_page) -> None:
    source = "# Title\n\nSome **bold**, *slanted* and `x<y`.\n\n- one\n- two\n\n```py\nif a < b:\n    pass\n```"
    html = browser_page.evaluate("(text) => renderMarkdown(text)", source)
    assert "<h2>Title</h2>" in html
    assert "<strong>bold</strong>" in html and "<em>slanted</em>" in html
    assert "<code>x&lt;y</code>" in html
    assert "<ul><li>one</li><li>two</li></ul>" in html
    assert '<pre><code class="language-py">if a &lt; b:\n    pass</code></pre>' in html
    assert "<script" not in browser_page.evaluate("(t) => renderMarkdown(t)", "<script>x</script>")
