"""The chat page at ``/`` in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``; ``.ci/run`` installs them) driven by Selenium against the real server.

A streamed reply appears as it comes, a long one stops mid-stream (and the server stops
generating), the expert heat map changes while the model answers, thinking is folded, the
markdown renderer lets no markup of the model's through, and with several models (router
mode) the header's picker chooses the one that answers. Skips, with the reason, where
Selenium, Chromium or its driver is missing. ``MOE_OFFLOAD_UI_SCREENSHOT=PATH`` saves a
screenshot taken mid-answer (docs/ui/chat-page.png comes from scripts/chat_page_screenshot.py,
with a larger model).
"""
from __future__ import annotations

import os
import re
import shutil
import time

import httpx
import pytest

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                "(pip install -e '.[test]')")
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

from tests.runtime.server.models_api import small_spec, statuses  # noqa: E402

# greedy decoding of this prompt on the tiny model runs thousands of tokens without an end
# token (test_http_api.py): seconds of streaming, so the page can stop it mid-answer
LONG_PROMPT = "the king saw a river near the old house and"
WAIT_S = 60


def _browser_paths() -> tuple[str, str]:
    binary = next((p for p in map(shutil.which, ("chromium", "chromium-browser",
                                                 "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no headless Chromium here: `apt-get install chromium chromium-driver` "
                    f"(found browser={binary}, driver={driver})")
    return binary, driver


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    # a RAM budget of 6 of the 32 experts (24 KiB each): the map shows RAM and storage, and
    # experts move while the model answers
    return start_server(tiny_model, "-c", "8192", "--devices.cpu", "150KiB")


@pytest.fixture(scope="module")
def browser():
    binary, driver_path = _browser_paths()
    options = Options()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,900"):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
    except WebDriverException as exc:
        pytest.skip(f"Chromium would not start: {exc.msg}")
    yield driver
    driver.quit()


@pytest.fixture()
def page(browser, server):
    """The page, freshly loaded, with its settings reset; its console must stay clean."""
    browser.get(server.base_url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get_log("browser")                      # what earlier pages logged
    browser.get(server.base_url + "/")
    _until(browser, lambda d: d.find_element(By.ID, "heatmap").get_attribute("data-routed"))
    yield browser
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def _until(driver, condition, timeout: float = WAIT_S):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def _settings(driver, **values: str) -> None:
    if not driver.find_element(By.ID, "settings").is_displayed():
        driver.find_element(By.ID, "settings-toggle").click()
    for name, value in values.items():
        field = driver.find_element(By.ID, name)
        field.clear()
        field.send_keys(value)


def _send(driver, text: str) -> None:
    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()


def _answers(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def _map_state(driver) -> tuple[int, str]:
    """(accesses so far, the canvas's pixels) of the heat map."""
    return driver.execute_script(
        "const c = document.getElementById('heatmap');"
        "return [Number(c.dataset.routed), c.toDataURL()];")


def test_streamed_reply(page, server):
    _settings(page, temperature="0", max_tokens="40")
    page.find_element(By.ID, "input").send_keys("hello there" + Keys.ENTER)   # Enter sends
    assert page.find_element(By.CSS_SELECTOR, ".msg.user .bubble").text == "hello there"
    # the reply's text shows while it streams, then the line under it says how fast it came
    _until(page, lambda d: _answers(d) and _answers(d)[-1].find_element(
        By.CLASS_NAME, "bubble").text.strip())
    stats = _until(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
    assert re.match(r"\d+ tokens · \d+\.\d tokens/s", stats[0].text), stats[0].text
    assert page.find_element(By.ID, "send").is_displayed()
    assert not page.find_element(By.ID, "stop").is_displayed()
    # and, from the expert panel's next update, what the answer cost in experts
    cost = _until(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .experts"))
    assert re.fullmatch(r"experts: \d+ % hits · [\d.]+ MiB moved in", cost[0].text), \
        cost[0].text
    # the conversation survives a reload; New chat forgets it
    answer = _answers(page)[-1].find_element(By.CLASS_NAME, "bubble").text
    line = stats[0].text
    page.refresh()
    assert page.find_element(By.CSS_SELECTOR, ".msg.user .bubble").text == "hello there"
    assert _answers(page)[-1].find_element(By.CLASS_NAME, "bubble").text == answer
    assert page.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text == line
    page.find_element(By.ID, "clear").click()
    page.refresh()
    assert not page.find_elements(By.CSS_SELECTOR, ".msg")
    assert page.find_element(By.ID, "empty").is_displayed()


def test_stop_mid_stream_while_the_heat_map_changes(page, server):
    _settings(page, temperature="0", max_tokens="6000")
    _send(page, LONG_PROMPT)
    stop = page.find_element(By.ID, "stop")
    bubble = _until(page, lambda d: _answers(d) and _answers(d)[-1].find_element(
        By.CLASS_NAME, "bubble"))
    _until(page, lambda d: bubble.text.strip())
    assert stop.is_displayed(), "the answer ended before the test could watch it"
    # the heat map follows the answer: more accesses, other pixels, while it still streams
    routed, pixels = _map_state(page)
    _until(page, lambda d: _map_state(d)[0] > routed and _map_state(d)[1] != pixels)
    assert stop.is_displayed(), "the answer ended before the heat map changed"
    shot = os.environ.get("MOE_OFFLOAD_UI_SCREENSHOT")
    if shot:
        page.save_screenshot(shot)
    streamed = len(bubble.text)
    stop.click()
    _until(page, lambda d: d.find_element(By.ID, "send").is_displayed())
    meta = _answers(page)[-1].find_element(By.CLASS_NAME, "meta").text
    assert "stopped" in meta, meta
    assert len(bubble.text) >= streamed > 0
    tokens = int(meta.split(" tokens")[0])
    assert 0 < tokens < 6000, meta
    # the server stopped generating too: nothing runs a moment later
    with httpx.Client(base_url=server.base_url, timeout=10) as http:
        deadline = time.monotonic() + 10
        while not re.search(r"^moe_server_requests_running 0$", http.get("/metrics").text,
                            re.M):
            assert time.monotonic() < deadline, "the server kept generating after Stop"
            time.sleep(0.1)
    # regenerate replaces the stopped answer with a new one
    _settings(page, max_tokens="8")
    _answers(page)[-1].find_element(By.CLASS_NAME, "regenerate").click()
    _until(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
    assert len(_answers(page)) == 1
    assert "stopped" not in _answers(page)[0].find_element(By.CLASS_NAME, "meta").text


# A stream with \r\n\r\n between events, cut at awkward places (inside a separator, inside a
# frame), thinking first, then markdown: what sse-starlette sends a reasoning model's page.
_FAKE_STREAM = r"""
const frames = [
  {choices: [{index: 0, delta: {role: "assistant", content: null}}]},
  {choices: [{index: 0, delta: {reasoning_content: "The user wants **code**."}}]},
  {choices: [{index: 0, delta: {content: "Here:\n\n```python\nprint('<b>hi</b>')\n```\n"}}]},
  {choices: [{index: 0, delta: {content: "- one\n- two"}}]},
  {choices: [{index: 0, delta: {}, finish_reason: "stop"}],
   timings: {predicted_n: 3, predicted_per_second: 42.5, prompt_n: 7}},
];
const text = ": ping\r\n\r\n" + frames.map((f) => "data: " + JSON.stringify(f) + "\r\n\r\n")
  .join("") + "data: [DONE]\r\n\r\n";
const bytes = new TextEncoder().encode(text);
const cuts = [3, 11, 40, 41, 97, 180, 181, 182, 260, bytes.length];
const realFetch = window.fetch;
window.fetch = (url, init) => {
  if (!String(url).includes("/chat/completions")) return realFetch(url, init);
  window.sentBody = JSON.parse(init.body);
  let at = 0, i = 0;
  const body = new ReadableStream({pull(controller) {
    if (i >= cuts.length || at >= bytes.length) { controller.close(); return; }
    const end = Math.min(cuts[i++], bytes.length);
    controller.enqueue(bytes.slice(at, end));
    at = end;
  }});
  return Promise.resolve(new Response(body, {status: 200,
    headers: {"Content-Type": "text/event-stream"}}));
};
"""


def test_thinking_folded_and_markdown_rendered(page):
    page.execute_script(_FAKE_STREAM)
    _settings(page, system="Answer in code.", temperature="0.3", top_p="0.5",
              max_tokens="77")
    _send(page, "show me code")
    stats = _until(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
    assert stats[0].text.startswith("3 tokens · 42.5 tokens/s"), stats[0].text
    answer = _answers(page)[0]
    thinking = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert thinking.get_attribute("open") is None                   # folded
    assert thinking.find_element(By.TAG_NAME, "summary").text.startswith("Thought for")
    assert thinking.find_element(By.TAG_NAME, "strong").get_attribute("textContent") == "code"
    code = answer.find_element(By.CSS_SELECTOR, ".bubble pre code")
    assert code.text == "print('<b>hi</b>')"                        # shown, not parsed
    assert not answer.find_elements(By.CSS_SELECTOR, ".bubble pre b")
    assert [li.text for li in answer.find_elements(By.CSS_SELECTOR, ".bubble li")] == \
        ["one", "two"]
    # what the page asked for: the system prompt first, the sampling settings, a stream
    # with its usage and timings
    sent = page.execute_script("return window.sentBody")
    assert sent["messages"] == [{"role": "system", "content": "Answer in code."},
                                {"role": "user", "content": "show me code"}]
    assert (sent["temperature"], sent["top_p"], sent["max_tokens"]) == (0.3, 0.5, 77)
    assert sent["stream"] and sent["stream_options"] == {"include_usage": True}
    # restored after a reload as it was: folded thinking, rendered code, the line under it
    summary = thinking.find_element(By.TAG_NAME, "summary").text
    page.refresh()
    answer = _answers(page)[0]
    assert answer.find_element(By.CSS_SELECTOR, "details.reasoning summary").text == summary
    assert answer.find_element(By.CSS_SELECTOR, ".bubble pre code").text == \
        "print('<b>hi</b>')"
    assert answer.find_element(By.CLASS_NAME, "stats").text.startswith("3 tokens · 42.5")


_HOSTILE = [
    "<img src=x onerror=alert(1)>",
    "<script>alert(1)</script>",
    "[click](javascript:alert(1))",
    "[click](JaVaScRiPt:alert(1))",
    "[x](http://a\"onmouseover=\"alert(1))",
    "[x](https://ok.example/\" onclick=\"alert(1)\")",
    "![img](http://x/y.png)",
    "`<b>code</b>` and <b>bold</b>",
    "```html\n<iframe src=//evil></iframe>\n```",
    "```\n</code></pre><svg onload=alert(1)>\n",
    "| a | <b>b</b> |\n|---|---|\n| <i>c</i> | d |",
    "> <a href=javascript:alert(1)>q</a>\n> - <x>",
    "- <svg/onload=alert(1)>\n  - nested <img src=x>",
    "http://x.example/\"><script>alert(1)</script>",
    "**<u>bold</u>** _<em>it</em>_ ~~<s>x</s>~~",
    "\u0000 0 \u0000 [a](http://x)",
    "# <h1>head</h1>\n---\n1. <li>x</li>",
    "&lt;b&gt; &amp; &#x3C;script&#x3E;",
]

_WALK = """
const allowed = new Set(["P", "BR", "STRONG", "EM", "DEL", "CODE", "PRE", "A", "UL", "OL", "LI",
  "BLOCKQUOTE", "H1", "H2", "H3", "H4", "H5", "H6", "HR", "TABLE", "THEAD", "TBODY", "TR",
  "TH", "TD", "DIV", "SPAN", "BUTTON"]);
const attrs = new Set(["href", "target", "rel", "class", "type", "start", "style"]);
const bad = [];
for (const source of arguments[0]) {
  const box = document.createElement("div");
  box.innerHTML = renderMarkdown(source);
  for (const el of box.querySelectorAll("*")) {
    if (!allowed.has(el.tagName)) bad.push([source, el.tagName]);
    for (const a of el.attributes) {
      if (!attrs.has(a.name)) bad.push([source, el.tagName + "@" + a.name]);
      if (a.name === "href" && !/^(https?:|mailto:)/i.test(a.value)) bad.push([source, a.value]);
      if (a.name === "style" && !/^text-align:(left|right|center)$/.test(a.value))
        bad.push([source, a.value]);
    }
  }
}
return bad;
"""


def test_markdown_lets_no_markup_through(page):
    assert page.execute_script(_WALK, _HOSTILE) == []
    html = page.execute_script("return renderMarkdown(arguments[0])",
                               "**b** *i* `c` [l](https://x.example/?a=1&b=2)")
    assert html == ('<p><strong>b</strong> <em>i</em> <code>c</code> <a href="https://x.example'
                    '/?a=1&amp;b=2" target="_blank" rel="noopener noreferrer">l</a></p>')
    text = page.execute_script(
        "const d = document.createElement('div'); d.innerHTML = renderMarkdown(arguments[0]);"
        "return d.textContent", "<img src=x onerror=alert(1)> [x](javascript:alert(1))")
    assert text == "<img src=x onerror=alert(1)> x"


_TYPICAL = """# Title
Some *text* with `code`, a [link](https://example.com/a_(b)) and https://example.org/x.

1. first
2. second
   - nested **bold**
   - nested two

> quoted
> still quoted

| name | n |
|:-----|--:|
| a \\| b | 1 |

```js
const x = 1 < 2;
```
---
"""


def test_markdown_renders_what_models_write(page):
    shape = page.execute_script("""
        const d = document.createElement('div'); d.innerHTML = renderMarkdown(arguments[0]);
        const tags = (sel) => [...d.querySelectorAll(sel)].map((e) => e.textContent);
        return {h1: tags('h1'), ol: tags('ol > li').length, nested: tags('ol ul > li'),
                strong: tags('strong'), quote: d.querySelector('blockquote').innerHTML,
                links: [...d.querySelectorAll('a')].map((a) => a.getAttribute('href')),
                th: tags('th'), td: tags('td'), align: d.querySelector('td').style.textAlign,
                code: tags('pre code'), lang: tags('.code-bar span'), hr: tags('hr').length};
        """, _TYPICAL)
    assert shape == {"h1": ["Title"], "ol": 2, "nested": ["nested bold", "nested two"],
                     "strong": ["bold"], "quote": "<p>quoted<br>still quoted</p>",
                     "links": ["https://example.com/a_(b)", "https://example.org/x"],
                     "th": ["name", "n"], "td": ["a | b", "1"], "align": "left",
                     "code": ["const x = 1 < 2;"], "lang": ["js"], "hr": 1}


def test_the_api_key_from_the_settings(browser, start_server, tiny_model):
    """With --api-key the page asks for the key; once it is in the settings, the expert
    panel and the chat work."""
    server = start_server(tiny_model, "--api-key", "page-key", "--devices.cpu", "150KiB")
    browser.get(server.base_url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(server.base_url + "/")
    _until(browser, lambda d: "API key" in d.find_element(By.ID, "experts-status").text)
    _settings(browser, key="page-key", max_tokens="8")
    browser.find_element(By.ID, "key").send_keys(Keys.TAB)        # "change": saved
    _send(browser, "hello")
    _until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")
    _until(browser, lambda d: int(d.find_element(By.ID, "heatmap").get_attribute(
        "data-routed") or 0) > 0)


# A snapshot with a GPU and the RAM tier (what a CUDA machine serves), for the map's merge:
# each expert shows the fastest tier holding it (a state is "R" resident or "-" absent).
_FAKE_RESIDENCY = r"""
const phases = {prefill: {accesses: 10, hits: 8, admitted_bytes: 0, prefetch_issued_bytes: 0,
                          evicted_bytes: 0},
                decode: {accesses: 7, hits: 7, admitted_bytes: 0, prefetch_issued_bytes: 0,
                         evicted_bytes: 0}};
const routed = [[5, 0, 1, 0], [0, 0, 9, 2]];
const device = (state) => ({capacity_bytes: 100, resident_bytes: 50, resident_experts: 2,
  note: "", phases, pools: [],
  experts: {layers: [1, 3], state, routed}});
const snapshot = {devices: {"cuda:0": device(["R---", "--R-"]), cpu: device(["RR--", "R---"])}};
const realFetch = window.fetch;
window.fetch = (url, init) => String(url).includes("/v1/residency")
  ? Promise.resolve(new Response(JSON.stringify(snapshot), {status: 200}))
  : realFetch(url, init);
document.dispatchEvent(new CustomEvent("moe-answer", {detail: false}));   // poll soon
"""

_PIXELS = """
const c = document.getElementById('heatmap'), [rows, cols] = arguments;
const dpr = c.width / c.clientWidth, cellW = (c.clientWidth - 22) / cols;
const cellH = c.height / dpr / rows, ctx = c.getContext('2d'), out = [];
for (let l = 0; l < rows; l++) for (let e = 0; e < cols; e++) {
  const x = Math.round((22 + (e + 0.5) * cellW) * dpr), y = Math.round((l + 0.5) * cellH * dpr);
  out.push([...ctx.getImageData(x, y, 1, 1).data]);
}
return out;
"""


def test_heat_map_places_each_expert(page):
    page.execute_script(_FAKE_RESIDENCY)
    _until(page, lambda d: d.find_element(By.ID, "heatmap").get_attribute("data-routed")
           == "17")
    assert page.find_element(By.ID, "heatmap").get_attribute("data-resident") == "4"
    assert page.find_element(By.ID, "map-caption").text.startswith("2 layers × 4 experts")
    colors = {"gpu": (16, 185, 129), "ram": (59, 130, 246), "disk": (168, 162, 158)}
    expected = ["gpu", "ram", "disk", "disk",
                "ram", "disk", "gpu", "disk"]       # layer 1, then layer 3
    assert page.find_element(By.CSS_SELECTOR, ".legend").text.split() == ["GPU", "RAM",
                                                                           "storage"]
    pixels = page.execute_script(_PIXELS, 2, 4)
    seen = [min(colors, key=lambda k: sum(abs(a - b) for a, b in zip(colors[k], p[:3])))
            for p in pixels]
    assert seen == expected, pixels
    alpha = [p[3] for p in pixels]
    assert alpha[6] > alpha[0] > alpha[2] > alpha[1]     # brighter: routed more (9, 5, 1, 0)
    rows = [r.get_attribute("data-phase") for r in page.find_elements(By.CSS_SELECTOR,
                                                                       "#phases tr[data-phase]")]
    assert rows == ["prefill", "decode"] * 2             # two devices, no mixed accesses


def _picked(driver) -> list[str]:
    """The picker's options (read at once: the page renews them as statuses change)."""
    return driver.execute_script(
        "return [...document.getElementById('model').options].map((o) => o.text)")


def test_the_model_picker_of_a_router(browser, start_server, synth_model_factory,
                                      tmp_path_factory):
    """Router mode: the header lists every model with its status; the picked one answers
    (loaded for it, the answer says how long that took), the expert panel maps it without
    loading a model just to look, and the choice survives a reload."""
    root = tmp_path_factory.mktemp("picker")
    for seed, name in enumerate(("alpha", "beta"), start=31):
        (root / f"{name}.gguf").symlink_to(synth_model_factory(small_spec(seed)))
    server = start_server(None, "--models-dir", str(root), "--devices.cpu", "300KiB",
                          "-c", "512")
    browser.get(server.base_url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get_log("browser")
    browser.get(server.base_url + "/")
    _until(browser, lambda d: _picked(d) == ["alpha · unloaded", "beta · unloaded"])
    picker = browser.find_element(By.ID, "model")
    assert picker.is_enabled()
    _until(browser, lambda d: "not loaded" in d.find_element(By.ID, "experts-status").text)
    Select(picker).select_by_value("beta")
    _settings(browser, max_tokens="8")
    _send(browser, "hello")
    stats = _until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
    assert re.search(r" · model loaded in \d+\.\d s$", stats[0].text), stats[0].text
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        models = statuses(http)
    assert (models["alpha"]["status"]["value"], models["beta"]["status"]["value"]) == \
        ("unloaded", "loaded")
    _until(browser, lambda d: "beta · loaded" in _picked(d))
    _until(browser, lambda d: int(d.find_element(By.ID, "heatmap").get_attribute(
        "data-routed") or 0) > 0)                    # beta's map, routed by the answer
    browser.refresh()
    _until(browser, lambda d: d.execute_script(
        "return document.getElementById('model').value") == "beta")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
