"""The web chat page `corelm serve` serves at /, in a real browser: headless Chromium (Debian's chromium
and chromium-driver) driven by Selenium. It asks for the API key, streams an answer with tokens/s, keeps
the conversation across a reload, shows model output containing HTML as text, and its stop button
ends a long answer (the server aborts it). The page's files are served offline, under a strict CSP.

Saves a screenshot to the test's tmp folder; with CORELM_UPDATE_SCREENSHOT=1, to docs/web-chat.png too."""
import os
import shutil
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import EMBEDDED_MODELS, ROOT  # noqa: E402
from test_server import _env, _free_port, wait_healthy  # noqa: E402

KEY = "web-key-456"
XSS = "<img src=x onerror=alert(1)>"
SMOLLM2 = os.path.join(EMBEDDED_MODELS, "SmolLM2-135M-Instruct.Q4_1.gguf")


def _browser_paths():
    chrome = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    return chrome, driver


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("needs selenium (pip install selenium) to drive a browser")
    chrome, driver = _browser_paths()
    if chrome is None or driver is None:
        pytest.skip("needs a system Chromium and chromedriver (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1100,820", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    b = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    b.set_script_timeout(30)
    try:
        yield b
    finally:
        b.quit()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`corelm serve` on the embedded SmolLM2, on loopback, with an API key."""
    port = _free_port()
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(KEY + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "corelm.entrypoints.cli", "serve", SMOLLM2, "--host", "127.0.0.1",
                             "--port", str(port), "-t", "2", "--ctx-size", "2048", "--api-key-file", str(key_file),
                             "--log-level", "warning"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 120)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)


def wait(browser, condition, timeout=60, message="timed out"):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(lambda b: condition(b), message)


def js(browser, script, *args):
    return browser.execute_script(script, *args)


def last_answer(browser):
    return js(browser, "const m = document.querySelectorAll('#messages .msg.assistant');"
                       "const a = m[m.length - 1]; return a ? [a.querySelector('.body').textContent,"
                       " a.querySelector('.stats').textContent] : null;")


def send(browser, text):
    from selenium.webdriver.common.by import By
    box = browser.find_element(By.ID, "input")
    box.clear()
    box.send_keys(text)
    browser.find_element(By.ID, "send").click()


def test_the_page_is_served_offline_with_a_strict_csp(served):
    r = httpx.get(served + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert "unsafe-inline" not in csp
    for name in ("chat.js", "chat.css"):
        f = httpx.get(served + "/static/" + name)
        assert f.status_code == 200
        assert "http://" not in f.text and "https://" not in f.text      # nothing fetched from elsewhere
    assert "http" not in r.text.replace("http-equiv", "")
    assert httpx.get(served + "/static/../app.py").status_code == 404
    assert httpx.get(served + "/static/app.py").status_code == 404


def test_web_chat(browser, served, tmp_path):
    from selenium.webdriver.common.by import By
    browser.get(served + "/")
    js(browser, "localStorage.clear(); sessionStorage.clear();")
    browser.refresh()
    # the server has a key: the page asks for it, and sends it as a Bearer token from then on
    wait(browser, lambda b: b.find_element(By.ID, "key-panel").is_displayed(), 10, "the page did not ask for the key")
    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.find_element(By.ID, "save-key").click()
    wait(browser, lambda b: not b.find_element(By.ID, "key-panel").is_displayed(), 10, "the key was not accepted")
    wait(browser, lambda b: b.find_element(By.ID, "model").text == "SmolLM2-135M-Instruct.Q4_1", 10)

    # settings: system prompt, greedy sampling, a short answer
    browser.find_element(By.ID, "toggle-settings").click()
    system = browser.find_element(By.ID, "system-prompt")
    system.clear()
    system.send_keys("You are a helpful assistant. Answer in one or two sentences.")
    for field, value in (("temperature", "0"), ("top-p", "1"), ("max-tokens", "40")):
        el = browser.find_element(By.ID, field)
        el.clear()
        el.send_keys(value)
    browser.find_element(By.ID, "toggle-settings").click()

    send(browser, "What is the capital of France?")
    wait(browser, lambda b: b.find_element(By.ID, "send").is_displayed() and last_answer(b)
         and "tokens/s" in last_answer(b)[1], 120, "no streamed answer")
    text, stats = last_answer(browser)
    assert len(text.strip()) > 0 and "Paris" in text, text
    assert "stopped" not in stats
    stored = js(browser, "return JSON.parse(localStorage.getItem('corelm.chat.v1'))")
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
    assert stored["messages"][1]["content"].strip() == text.strip()
    assert stored["settings"]["max_tokens"] == "40"

    # the conversation survives a reload
    browser.refresh()
    wait(browser, lambda b: len(b.find_elements(By.CSS_SELECTOR, "#messages .msg")) == 2, 10)
    assert last_answer(browser)[0].strip() == text.strip()

    # model output with HTML in it is shown as text: an answer streamed by a stand-in for the server
    # (window.fetch replaced for this one request), rendered by the page's own markdown renderer
    js(browser, """
        const pieces = arguments[0];
        const real = window.fetch;
        window.fetch = (url, init) => {
          window.fetch = real;
          const enc = new TextEncoder();
          const stream = new ReadableStream({ start(c) {
            for (const p of pieces) c.enqueue(enc.encode('data: ' + JSON.stringify(
              {choices: [{index: 0, delta: {content: p}, finish_reason: null}]}) + '\\n\\n'));
            c.enqueue(enc.encode('data: [DONE]\\n\\n'));
            c.close();
          }});
          return Promise.resolve(new Response(stream, {status: 200, headers: {'Content-Type': 'text/event-stream'}}));
        };""", ["Here is ", XSS[:9], XSS[9:], " as **bold** and *em* text, `<b>inline</b>`:\n\n",
                "```html\n<script>window.pwned = 1</script>\n", "```\nDone."])
    send(browser, "Show me some HTML.")
    wait(browser, lambda b: b.find_element(By.ID, "send").is_displayed() and last_answer(b)
         and "Done." in last_answer(b)[0], 10)
    answer = browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")[-1]
    assert XSS in answer.text
    assert not browser.find_elements(By.CSS_SELECTOR, "#messages img, #messages script, #messages b")
    assert answer.find_element(By.CSS_SELECTOR, "strong").text == "bold"
    assert answer.find_element(By.CSS_SELECTOR, "em").text == "em"
    assert answer.find_element(By.CSS_SELECTOR, "p code").text == "<b>inline</b>"
    assert answer.find_element(By.CSS_SELECTOR, "pre code").text == "<script>window.pwned = 1</script>"
    assert js(browser, "return window.pwned === undefined")
    rendered = js(browser, "return window.corelmChat.render(arguments[0])", XSS + ' "quoted" & \'single\'')
    assert "<img" not in rendered and "&lt;img src=x onerror=alert(1)&gt;" in rendered
    assert "&quot;quoted&quot; &amp; &#39;single&#39;" in rendered

    shot = str(tmp_path / "web-chat.png")
    browser.save_screenshot(shot)
    if os.environ.get("CORELM_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, os.path.join(ROOT, "docs", "web-chat.png"))

    # stop: a long answer from the server, stopped mid-stream; the server aborts the request
    js(browser, "document.getElementById('max-tokens').value = '1500';"
                "document.getElementById('temperature').value = '0.9';")
    send(browser, "Write a very long story about a dragon who learns to bake bread, with many chapters.")
    wait(browser, lambda b: b.find_element(By.ID, "stop").is_displayed() and len(last_answer(b)[0]) > 20, 60,
         "the long answer did not start")
    browser.find_element(By.ID, "stop").click()
    wait(browser, lambda b: b.find_element(By.ID, "send").is_displayed(), 5, "stop did not end the answer")
    text, stats = last_answer(browser)
    assert "(stopped)" in stats
    time.sleep(0.5)
    assert last_answer(browser)[0] == text          # nothing more arrives
    deadline = time.monotonic() + 10
    while True:
        metrics = httpx.get(served + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        if "corelm_requests_running 0" in metrics and "corelm_requests_waiting 0" in metrics:
            break
        assert time.monotonic() < deadline, "the server kept generating the stopped answer"
        time.sleep(0.1)
    stored = js(browser, "return JSON.parse(localStorage.getItem('corelm.chat.v1'))")["messages"][-1]
    assert "(stopped)" in stored["stats"]
    shown = js(browser, "const d = document.createElement('div'); d.innerHTML = window.corelmChat.render(arguments[0]);"
                        "return d.textContent;", stored["content"])
    assert shown == text                              # the partial answer is kept


def test_the_page_ships_with_the_package():
    """The static files sit inside the imported package: where the tests run against an installed wheel
    (.ci/run installs with pip), this checks that the wheel carries them."""
    import corelm.entrypoints.server as server
    static = os.path.join(os.path.dirname(server.__file__), "static")
    for name in ("index.html", "chat.js", "chat.css"):
        assert os.path.isfile(os.path.join(static, name)), name
