"""The chat page at `/`, in headless Chromium (Debian's `chromium`, driven by Playwright), against
a real `trio-mlx serve` on a tiny model: streamed answers, stop, settings, errors, phone width,
the API-key prompt, safe Markdown. Skipped only where /usr/bin/chromium is absent."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Request, sync_playwright

from servers import keep_reading_log, serve_process
from tiny_model import build_tiny_model

CHROMIUM = Path("/usr/bin/chromium")
KEY = "sk-page-test-key"

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="no /usr/bin/chromium (Debian's chromium package; .ci/run installs it)",
)


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The tiny model with room for answers far longer than a test waits (a stop always lands
    # mid-answer).
    return build_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-long", max_position_embeddings=32768
    )


@pytest.fixture(scope="module")
def server_url(long_model_dir: Path) -> Iterator[str]:
    with serve_process(long_model_dir, "--served-model-name", "tiny-chat") as (process, url):
        keep_reading_log(process)
        yield url


@pytest.fixture(scope="module")
def keyed_server_url(long_model_dir: Path) -> Iterator[str]:
    with serve_process(long_model_dir, "--api-key", KEY) as (process, url):
        keep_reading_log(process)
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        yield browser
        browser.close()


@dataclass
class ChatPage:
    """A browser page on the chat page, with what it logged and what it fetched."""

    page: Page
    url: str
    console_errors: list[str] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)

    def open(self) -> None:
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda error: self.console_errors.append(f"pageerror: {error}"))
        self.page.on("request", lambda request: self.requests.append(request))
        self.page.goto(self.url)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.console_errors.append(message.text)

    def wait_for_model(self) -> str:
        self.page.wait_for_selector("#model[data-ready]", timeout=30_000)
        return self.page.inner_text("#model")

    def settings(self, **values: str) -> None:
        """Fill the settings panel (`system`, `temperature`, `top_p`, `max_tokens`)."""
        ids = {"system": "#system", "temperature": "#temperature", "top_p": "#top-p"}
        ids["max_tokens"] = "#max-tokens"
        self.page.click("#settings-toggle")
        for name, value in values.items():
            self.page.fill(ids[name], value)
        self.page.click("#settings-toggle")

    def send(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def last_answer(self) -> Any:
        return self.page.locator(".message.assistant").last

    def wait_answer_state(self, state: str, timeout: float = 60_000) -> None:
        self.page.wait_for_selector(
            f".message.assistant:last-of-type[data-state={state}]", timeout=timeout
        )

    def figure(self, name: str) -> str:
        return self.page.inner_text(f'#figures [data-figure="{name}"]')

    def completion_tokens(self) -> int:
        """The `N out` of the tokens figure."""
        return int(self.figure("tokens").split(" out")[0].split()[-1])


@pytest.fixture
def chat(browser: Browser, server_url: str) -> Iterator[ChatPage]:
    context = browser.new_context(viewport={"width": 1000, "height": 800})
    page = ChatPage(context.new_page(), server_url)
    page.open()
    yield page
    context.close()


def server_status(url: str) -> dict[str, Any]:
    status: dict[str, Any] = httpx.get(url + "/v1/status", timeout=10).json()
    return status


def wait_until(predicate: Any, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    for _ in range(int(limit / 0.05) + 1):
        if predicate():
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    raise AssertionError(f"not true within {limit} s: {predicate}")


def record_renders(page: Page) -> None:
    """Keep, in the page, the length of the last answer's text at each change of it."""
    page.evaluate(
        """() => {
          window.__lengths = [];
          new MutationObserver(() => {
            const answers = document.querySelectorAll('.message.assistant .content');
            const last = answers[answers.length - 1];
            if (last) window.__lengths.push(last.textContent.length);
          }).observe(document.getElementById('conversation'),
                     {childList: true, subtree: true, characterData: true});
        }"""
    )


def test_a_message_sent_with_enter_streams_an_answer_rendered_from_the_servers_text(
    chat: ChatPage,
) -> None:
    assert chat.wait_for_model() == "tiny-chat"
    chat.settings(temperature="0", max_tokens="300")
    record_renders(chat.page)
    chat.page.fill("#prompt", "Hello")
    chat.page.press("#prompt", "Shift+Enter")
    chat.page.type("#prompt", "there")
    assert chat.page.input_value("#prompt") == "Hello\nthere"  # Shift+Enter: a new line
    assert chat.page.locator(".message").count() == 0
    chat.page.press("#prompt", "Enter")
    chat.wait_answer_state("done")

    assert chat.page.input_value("#prompt") == ""
    assert chat.page.inner_text(".message.user .content") == "Hello\nthere"
    lengths = [n for n in chat.page.evaluate("window.__lengths") if n > 0]
    assert len(set(lengths)) > 1, "the answer appeared all at once, not streamed"
    assert lengths == sorted(lengths)

    # What the page shows is the server's answer to the same request, rendered.
    reply = httpx.post(
        chat.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hello\nthere"}],
            "temperature": 0,
            "max_tokens": 300,
        },
        timeout=60,
    ).json()
    expected = chat.page.evaluate(
        """async (text) => {
          const { renderMarkdown } = await import('/page/markdown.js');
          const holder = document.createElement('div');
          holder.append(renderMarkdown(text));
          return holder.textContent;
        }""",
        reply["choices"][0]["message"]["content"],
    )
    assert chat.last_answer().locator(".content").text_content() == expected
    assert chat.completion_tokens() == reply["usage"]["completion_tokens"]
    assert chat.figure("ttft").endswith(" ms")
    assert float(chat.figure("tps")) > 0
    assert chat.figure("cached").isdigit()
    assert chat.console_errors == []


@pytest.mark.parametrize("how", ["button", "escape"])
def test_stop_during_a_long_answer_ends_it_and_frees_the_servers_slot(
    chat: ChatPage, how: str
) -> None:
    chat.wait_for_model()
    before = server_status(chat.url)
    chat.settings(max_tokens="30000")
    chat.send("Write a very long story")
    chat.page.wait_for_function(
        """() => {
          const a = document.querySelector('.message.assistant:last-of-type');
          return a && a.dataset.state === 'streaming' && a.querySelector('.content').textContent;
        }""",
        timeout=30_000,
    )
    assert chat.page.is_visible("#stop") and not chat.page.is_visible("#send")
    if how == "button":
        chat.page.click("#stop")
    else:
        chat.page.keyboard.press("Escape")
    chat.wait_answer_state("stopped", timeout=10_000)

    assert chat.page.is_visible("#send") and not chat.page.is_visible("#stop")
    assert chat.last_answer().locator(".status").inner_text() == "Stopped."
    assert chat.last_answer().locator(".content").inner_text() != ""

    def freed() -> bool:
        status = server_status(chat.url)
        return bool(
            status["running"] == 0 and status["runner"]["aborted"] > before["runner"]["aborted"]
        )

    wait_until(freed)
    after = server_status(chat.url)
    assert after["runner"]["generated_tokens"] - before["runner"]["generated_tokens"] < 30000
    # The page can go on: the next message is answered.
    chat.settings(max_tokens="4")
    chat.send("Hi again")
    chat.wait_answer_state("done")
    assert chat.console_errors == []


def test_the_settings_are_sent_and_max_tokens_is_respected(chat: ChatPage) -> None:
    chat.wait_for_model()
    chat.settings(system="You answer in one word.", temperature="0.5", top_p="0.9", max_tokens="7")
    with chat.page.expect_request("**/v1/chat/completions") as caught:
        chat.send("Name a colour")
    body = json.loads(caught.value.post_data or "{}")
    assert body["messages"] == [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour"},
    ]
    assert body["temperature"] == 0.5 and body["top_p"] == 0.9 and body["max_tokens"] == 7
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "tiny-chat"
    chat.wait_answer_state("done")
    assert 1 <= chat.completion_tokens() <= 7

    # The settings are kept in the browser: a reload shows them again.
    chat.page.reload()
    chat.wait_for_model()
    assert chat.page.input_value("#max-tokens") == "7"
    assert chat.page.input_value("#system") == "You answer in one word."
    assert chat.console_errors == []


def test_the_conversation_is_sent_back_with_each_new_message(chat: ChatPage) -> None:
    chat.wait_for_model()
    chat.settings(max_tokens="3")
    chat.send("First")
    chat.wait_answer_state("done")
    first_answer = chat.page.evaluate(
        "() => document.querySelector('.message.assistant .content').textContent"
    )
    with chat.page.expect_request("**/v1/chat/completions") as caught:
        chat.send("Second")
    messages = json.loads(caught.value.post_data or "{}")["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0]["content"] == "First" and messages[2]["content"] == "Second"
    assert messages[1]["content"].strip() != "" and first_answer != ""
    chat.wait_answer_state("done")
    chat.page.click("#new-chat")
    assert chat.page.locator(".message").count() == 0
    assert chat.console_errors == []


def test_an_error_response_is_shown_readably_and_the_message_goes_back_to_the_box(
    chat: ChatPage,
) -> None:
    chat.wait_for_model()
    chat.settings(temperature="7")
    chat.send("Hello")
    chat.wait_answer_state("error")
    status = chat.last_answer().locator(".status")
    text = status.inner_text()
    assert text.startswith("HTTP 400 (invalid_value, temperature): ")
    assert status.get_attribute("role") == "alert"
    assert chat.page.input_value("#prompt") == "Hello"
    # The failed request's 400 is the browser's only console error.
    assert all("400" in e for e in chat.console_errors)


def test_the_page_fetches_nothing_from_another_origin(chat: ChatPage) -> None:
    chat.wait_for_model()
    chat.settings(max_tokens="3")
    chat.send("Hello")
    chat.wait_answer_state("done")
    urls = [r.url for r in chat.requests]
    assert any(u.endswith("/page/chat.js") for u in urls)
    assert all(u.startswith(chat.url + "/") for u in urls), urls
    assert chat.console_errors == []


def test_at_phone_width_nothing_overflows_sideways(browser: Browser, server_url: str) -> None:
    context = browser.new_context(viewport={"width": 375, "height": 740}, is_mobile=True)
    chat = ChatPage(context.new_page(), server_url)
    chat.open()
    chat.wait_for_model()
    chat.settings(max_tokens="60", system="s" * 400)
    chat.page.click("#settings-toggle")  # leave the panel open
    chat.send("a-very-long-unbroken-word-" * 20 + "\n```\n" + "x" * 300 + "\n```")
    chat.wait_answer_state("done")
    widths = chat.page.evaluate(
        """() => ({
          page: document.documentElement.scrollWidth,
          body: document.body.scrollWidth,
          view: document.documentElement.clientWidth,
          widest: Math.max(...[...document.querySelectorAll('body *')]
                              .map(e => e.getBoundingClientRect().right)),
        })"""
    )
    assert widths["view"] == 375
    assert widths["page"] <= 375 and widths["body"] <= 375, widths
    assert widths["widest"] <= 375.5, widths
    assert chat.page.is_visible("#send")
    context.close()
    assert chat.console_errors == []


def test_a_server_with_an_api_key_makes_the_page_ask_for_it_once(
    browser: Browser, keyed_server_url: str
) -> None:
    context = browser.new_context()
    chat = ChatPage(context.new_page(), keyed_server_url)
    chat.open()
    dialog = chat.page.locator("#key-dialog")
    dialog.wait_for(state="visible", timeout=30_000)
    chat.page.fill("#api-key", "not-the-key")
    chat.page.press("#api-key", "Enter")
    chat.page.wait_for_function(
        "() => document.getElementById('key-message').textContent.includes('refused')"
    )
    assert dialog.is_visible()
    chat.page.fill("#api-key", KEY)
    chat.page.press("#api-key", "Enter")
    assert chat.wait_for_model() == "tiny-long"
    assert not dialog.is_visible()
    chat.settings(max_tokens="4")
    chat.send("Hello")
    chat.wait_answer_state("done")
    assert chat.page.evaluate("localStorage.getItem('trio-mlx.api-key')") == KEY

    chat.page.reload()  # the key is remembered
    assert chat.wait_for_model() == "tiny-long"
    assert not dialog.is_visible()
    context.close()
    # Chromium logs each refused request; the two 401s are the only console errors.
    assert len(chat.console_errors) == 2
    assert all("401" in e for e in chat.console_errors), chat.console_errors


def test_declining_the_key_shows_the_refusal(browser: Browser, keyed_server_url: str) -> None:
    context = browser.new_context()
    chat = ChatPage(context.new_page(), keyed_server_url)
    chat.open()
    chat.page.locator("#key-dialog").wait_for(state="visible", timeout=30_000)
    chat.page.click("#key-dialog button[value=cancel]")
    chat.page.wait_for_function(
        "() => document.getElementById('model').textContent.startsWith('HTTP 401')"
    )
    assert "invalid_api_key" in chat.page.inner_text("#model")
    context.close()


def render(page: Page, markdown: str) -> Any:
    """`markdown` through the page's renderer: its HTML and some counts."""
    return page.evaluate(
        """async (text) => {
          const { renderMarkdown } = await import('/page/markdown.js');
          const holder = document.createElement('div');
          holder.append(renderMarkdown(text));
          const count = (s) => holder.querySelectorAll(s).length;
          return {
            html: holder.innerHTML,
            text: holder.textContent,
            scripts: count('script'), images: count('img'), iframes: count('iframe'),
            handlers: [...holder.querySelectorAll('*')]
              .flatMap(e => [...e.attributes].map(a => a.name))
              .filter(n => n.startsWith('on')).length,
            links: [...holder.querySelectorAll('a')].map(a => [a.getAttribute('href'), a.rel]),
          };
        }""",
        markdown,
    )


def test_markdown_in_answers_never_becomes_markup(chat: ChatPage) -> None:
    chat.wait_for_model()
    hostile = (
        '<script>window.hit = 1</script> <img src=x onerror="window.hit = 2">\n\n'
        "[click](javascript:alert(1)) [data](data:text/html,<b>x</b>) "
        '<a href="javascript:alert(1)">a</a>\n\n'
        '```html\n<iframe src="javascript:alert(1)"></iframe>\n```\n'
        "`<b>code</b>` **<i>bold</i>**"
    )
    out = render(chat.page, hostile)
    assert out["scripts"] == out["images"] == out["iframes"] == out["handlers"] == 0
    assert out["links"] == []
    assert "<script>window.hit = 1</script>" in out["text"]
    assert '<iframe src="javascript:alert(1)"></iframe>' in out["text"]
    assert chat.page.evaluate("window.hit") is None
    assert chat.console_errors == []


def test_markdown_renders_paragraphs_emphasis_code_lists_and_links(chat: ChatPage) -> None:
    chat.wait_for_model()
    out = render(
        chat.page,
        "# Title\n\nSome *em*, **strong**, `a_b` and snake_case_name.\nNext line.\n\n"
        "- one\n- two\n  - nested\n\n1. first\n2. second\n\n"
        "```python\nprint('hi')\n```\n\n"
        "See [the docs](https://example.org/x) or https://example.org/y.",
    )
    html = out["html"]
    assert "<h1>Title</h1>" in html
    assert "<em>em</em>" in html and "<strong>strong</strong>" in html
    assert "<code>a_b</code>" in html and "snake_case_name" in html and "<br>" in html
    assert "<ul><li>one</li><li>two<ul><li>nested</li></ul></li></ul>" in html
    assert "<ol><li>first</li><li>second</li></ol>" in html
    assert (
        '<pre data-language="python"><code data-language="python">print(\'hi\')</code></pre>'
        in html
    )
    assert out["links"] == [
        ["https://example.org/x", "noopener noreferrer"],
        ["https://example.org/y", "noopener noreferrer"],
    ]


def test_markdown_delimiters_left_open_stay_text_and_later_ones_still_work(chat: ChatPage) -> None:
    chat.wait_for_model()
    out = render(chat.page, "2 * 3 and `x and **y and [z\n\na *b* `c` **d** [e](https://e.org)")
    assert out["html"] == (
        "<p>2 * 3 and `x and **y and [z</p>"
        '<p>a <em>b</em> <code>c</code> <strong>d</strong> <a href="https://e.org" '
        'target="_blank" rel="noopener noreferrer">e</a></p>'
    )
    # A `*` that opens nothing does not stop a later one from opening emphasis.
    assert render(chat.page, "2 * 3 is *six*, a_b is _c_")["html"] == (
        "<p>2 * 3 is <em>six</em>, a_b is <em>c</em></p>"
    )


def test_markdown_renders_any_text_without_failing(chat: ChatPage) -> None:
    # Pseudo-random strings of Markdown's delimiters (a fixed seed), each rendered in the page:
    # an answer is re-rendered as it grows, so every prefix of any text must render.
    chat.wait_for_model()
    failures = chat.page.evaluate(
        r"""async () => {
          const { renderMarkdown } = await import('/page/markdown.js');
          let seed = 7;
          const next = () => (seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648;
          const pieces = ['*', '**', '_', '__', '~~', '`', '```', '~~~', '\n', '\n\n', '  ',
            '- ', '1. ', '2) ', '> ', '# ', '---', '[', ']', '(', ')', '<', '>', '\\', 'a',
            'word', ' ', '\t', 'https://a.b/c', '<script>', '"', "'"];
          const failures = [];
          for (let n = 0; n < 2000 && failures.length < 5; n++) {
            let text = '';
            const length = Math.floor(next() * 40);
            for (let i = 0; i < length; i++) text += pieces[Math.floor(next() * pieces.length)];
            try {
              const holder = document.createElement('div');
              holder.append(renderMarkdown(text));
              if (holder.querySelector('script')) failures.push(['markup', text]);
            } catch (error) {
              failures.push([String(error), text]);
            }
          }
          return failures;
        }"""
    )
    assert failures == []


def test_reasoning_is_shown_collapsed_above_the_answer(chat: ChatPage) -> None:
    # The tiny model has no reasoning parser, so the stream is the page's input here: a canned
    # SSE body in the server's chunk format, served to the page in place of the server's.
    chat.wait_for_model()
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "Think *first*."}}]},
        {"choices": [{"index": 0, "delta": {"content": "The **answer**."}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 9,
                "completion_tokens": 6,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        },
    ]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    chat.page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=body),
    )
    chat.send("Why?")
    chat.wait_answer_state("done")
    reasoning = chat.last_answer().locator("details.reasoning")
    assert reasoning.is_visible() and reasoning.get_attribute("open") is None
    assert reasoning.locator("summary").inner_text() == "Reasoning"
    assert reasoning.locator(".reasoning-text em").text_content() == "first"
    assert chat.last_answer().locator(".content strong").inner_text() == "answer"
    assert chat.figure("cached") == "4"
    assert chat.figure("tokens") == "9 in, 6 out"
    assert chat.console_errors == []
