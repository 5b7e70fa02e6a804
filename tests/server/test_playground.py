"""The browser playground at `GET /`: headless Chromium (Debian's chromium and chromium-driver, which `make test`
installs) drives the page of a live server (the app `kestrel serve` runs) on the bundled kestrel-tiny model: the
API key, the model picker, a streamed greedy answer (the same text the `openai` client gets) and the metrics charts.

`pytest -m 'not browser'` deselects the browser test; without Chromium it fails, saying how to install it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import API_KEY, MODEL, LiveServer
from http_client import HTTP

from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server import build_app
from kestrel.tiny import default_model_path

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MESSAGE = "Write a function that reverses a string."
MAX_TOKENS = 64
SEED = 7

# Records, from inside the page, the answer's text each time it changes while it streams.
RECORD_GROWTH = """
window.__growth = [];
new MutationObserver(() => {
  const answer = [...document.querySelectorAll('#chat-log .msg.assistant')].pop();
  if (answer) window.__growth.push([answer.dataset.state, answer.querySelector('.content').textContent.length]);
}).observe(document.getElementById('chat-log'), {subtree: true, childList: true, characterData: true});
"""


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[LiveServer]:
    """kestrel-tiny served behind the key API_KEY, in this process (a `kestrel serve` process would import torch
    and transformers again: ~15 s on a small machine)."""
    engine = AsyncEngine.from_args(str(default_model_path()), device="cpu", dtype="float32", max_num_seqs=8,
                                   kv_cache_blocks=256).start()
    server = LiveServer(build_app(engine, MODEL, api_key=API_KEY), engine)
    yield server
    server.stop()


@pytest.fixture
def browser() -> Iterator[Any]:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        pytest.fail(f"the browser test needs Debian's chromium and chromium-driver ({', '.join(missing)} missing): "
                    "run `make test`, which installs them (or `apt-get install chromium chromium-driver`); "
                    "`pytest -m 'not browser'` leaves this test out", pytrace=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--window-size=1280,900"):
        options.add_argument(flag)
    with tempfile.TemporaryDirectory(prefix="kestrel-chromium-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        # An explicit driver and browser: Selenium Manager never runs (the machine has no network).
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
        try:
            yield driver
        finally:
            driver.quit()


def _set(driver: Any, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def _samples(driver: Any) -> list[dict[str, Any]]:
    return driver.execute_script("return window.kestrelPlayground.samples")


@pytest.mark.browser
def test_playground_streams_a_chat_answer_and_charts_the_metrics(tiny_server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = browser
    wait = WebDriverWait(driver, 20, poll_frequency=0.02)
    driver.get(f"{tiny_server.base_url}/")
    # The page loads without the key; the model list does not, and the page says why.
    wait.until(lambda d: "API key" in d.find_element(By.ID, "status").text)
    assert not driver.find_elements(By.CSS_SELECTOR, "#model option")

    _set(driver, "api-key", API_KEY)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#model option[value='{MODEL}']"))
    Select(driver.find_element(By.ID, "model")).select_by_value(MODEL)
    for element_id, value in (("temperature", "0"), ("top-p", "1"), ("max-tokens", str(MAX_TOKENS)),
                              ("seed", str(SEED))):
        _set(driver, element_id, value)

    wait.until(lambda d: len(_samples(d)) >= 1)  # the metrics poll runs
    points_before = int(driver.find_element(By.ID, "chart-tps").get_attribute("data-points"))
    picture = "return document.getElementById('chart-tps').toDataURL()"
    chart_before = driver.execute_script(picture)
    sent_at = driver.execute_script(RECORD_GROWTH + "return performance.now();")
    _set(driver, "prompt", MESSAGE)
    driver.find_element(By.ID, "send").click()

    answer = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#chat-log .msg.assistant"))
    wait.until(lambda d: answer.get_attribute("data-state") != "streaming")
    assert answer.get_attribute("data-state") == "done", answer.text
    text = driver.execute_script("return arguments[0].querySelector('.content').textContent", answer)

    # It streamed: the page showed a part of the answer, then more of it, before the end.
    growth = driver.execute_script("return window.__growth")
    streaming = [length for state, length in growth if state == "streaming" and length > 0]
    assert len(set(streaming)) >= 2 and min(streaming) < len(text), growth
    assert [length for _, length in growth] == sorted(length for _, length in growth)
    assert int(answer.get_attribute("data-chunks")) >= 2

    # The same greedy request through the official client answers the same text.
    reference = tiny_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": MESSAGE}], temperature=0, top_p=1, max_tokens=MAX_TOKENS,
        seed=SEED)
    assert text and text == reference.choices[0].message.content
    stats = driver.find_element(By.ID, "chat-stats").text
    assert f"{reference.usage.completion_tokens} completion tokens" in stats, stats

    # The metrics view: new points on the chart, and a generation rate above 0 since the request.
    def charted(d: Any) -> bool:
        points = int(d.find_element(By.ID, "chart-tps").get_attribute("data-points"))
        rates = [s["tps"] for s in _samples(d) if s["time"] > sent_at and s["tps"] is not None]
        return points >= points_before + 2 and bool(rates) and max(rates) > 0

    WebDriverWait(driver, 10, poll_frequency=0.1).until(charted)
    assert driver.execute_script(picture) != chart_before  # the line was drawn anew
    assert int(driver.find_element(By.ID, "chart-requests").get_attribute("data-points")) >= points_before + 2
    assert driver.find_element(By.ID, "m-running").text in {"0", "1"}
    assert driver.find_element(By.ID, "m-kv").text.endswith("%")

    errors = [entry for entry in driver.get_log("browser") if entry.get("source") == "javascript"]
    assert not errors, errors


def test_playground_page_is_open_and_outside_the_api(scripted):
    server, _ = scripted
    page = HTTP.get(f"{server.base_url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        assert f'"static/{name}"' in page.text  # relative: the page works under --root-path too
        response = HTTP.get(f"{server.base_url}/static/{name}")
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
    for path in ("/static/nope.js", "/static/..%2Fserver.py", "/static/"):
        response = HTTP.get(f"{server.base_url}{path}")
        assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert HTTP.get(f"{server.base_url}/v1/models").status_code == 401  # the API stays behind the key
    paths = HTTP.get(f"{server.base_url}/openapi.json", headers=server.headers).json()["paths"]
    assert "/" not in paths and not any(p.startswith("/static") for p in paths)
