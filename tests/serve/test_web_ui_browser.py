"""The web view in a real headless Chromium (Debian's, driven by Selenium through
/usr/bin/chromedriver; ``scripts/chromium.sh ensure`` installs both): no data without
the key, no console errors, a chat reply streams in, the block map and the hit rate
change after two requests sharing a prefix, pin / unpin from the prefix tree, a forced
tool call shown and kept in the chat, and a server restart shows a reconnect notice.
Screenshots go to the test's tmp dir (and to ``$KVSTACK_WEB_SCREENSHOTS`` when set:
``docs/`` for the docs' web-view.png)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from kvstack import LLM
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf
from server_util import free_port, serve_uvicorn

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
KEY = "browser-key"
pytestmark = pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)),
    reason="needs Debian's chromium + chromium-driver: bash scripts/chromium.sh ensure",
)
TOOLS = [{"type": "function", "function": {
    "name": "opening_hours", "description": "The museum's opening hours on a day",
    "parameters": {"type": "object", "required": ["day"],
                   "properties": {"day": {"type": "string", "enum": ["weekday", "sunday"]}}},
}}]  # fmt: skip
SYSTEM = (
    "You are the assistant of a lighthouse museum. Answer in one short sentence about "
    "opening hours, tickets, the lamp room and the keeper's cottage. "
)


class Server:
    """A tiny-model server on a fixed port that can be stopped and started again."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._stack: ExitStack | None = None
        self.app: Any = None

    def start(self) -> None:
        llm = LLM(str(self.model), dtype="float32", num_blocks=96, max_model_len=1024)
        self.app = create_app(AsyncEngine(llm.engine), ServerConfig("tiny", api_key=KEY))
        self._stack = ExitStack()
        self._stack.enter_context(serve_uvicorn(self.app, port=self.port, shutdown_grace=1))

    def stop(self) -> None:
        assert self._stack is not None
        self.app.state.kv_state.close()
        self._stack.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = tiny_llama_config(max_position_embeddings=1024)  # a tools prompt is ~650 tokens
    path = tmp_path_factory.mktemp("tiny") / "t.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg))
    s = Server(path)
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1200", "--disable-extensions"):  # fmt: skip
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Any, str], Path]:
    out = tmp_path_factory.mktemp("screenshots")

    def shot(driver: Any, name: str) -> Path:
        path = out / f"{name}.png"
        assert driver.save_screenshot(str(path)) and path.stat().st_size > 10_000
        target = os.environ.get("KVSTACK_WEB_SCREENSHOTS")
        if target:
            shutil.copy(path, Path(target) / f"web-view-{name}.png")
        return path

    return shot


def wait(cond: Callable[[], Any], timeout_s: float = 20.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or cond}")


def js(driver: Any, script: str) -> Any:
    return driver.execute_script(script)


def text(driver: Any, id_: str) -> str:
    return str(js(driver, f"return document.getElementById('{id_}').textContent"))


def visible(driver: Any, id_: str) -> bool:
    return bool(js(driver, f"return !document.getElementById('{id_}').hidden"))


def totals(driver: Any) -> dict[str, int]:
    raw = js(driver, "return document.getElementById('blockmap').dataset.totals || ''")
    return json.loads(raw) if raw else {}


def hit_rate(driver: Any) -> float:
    return float(js(driver, "return document.getElementById('summary').dataset.hitRate"))


def severe_logs(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def chat(
    driver: Any, text: str, system: str = "", max_tokens: int = 12, streamed: bool = True
) -> str:
    """Send one message; returns the reply once streamed, after checking it arrived in
    more than one piece (a MutationObserver counts the bubble's updates; a reply that is
    only tool calls is drawn once, at the end: ``streamed=False``)."""
    n_before = js(driver, "return document.querySelectorAll('.msg.assistant').length")
    js(
        driver,
        f"""
        document.getElementById('system').value = {json.dumps(system)};
        document.getElementById('prompt').value = {json.dumps(text)};
        document.getElementById('opt-max_tokens').value = '{max_tokens}';
        document.getElementById('opt-temperature').value = '0';
        window.__updates = 0;
        new MutationObserver((ms) => {{
          for (const m of ms) for (const n of m.addedNodes)
            if (n.classList && n.classList.contains('assistant'))
              new MutationObserver(() => window.__updates++).observe(
                n, {{childList: true, characterData: true, subtree: true}});
        }}).observe(document.getElementById('chat'), {{childList: true}});
        document.getElementById('send').click();
    """,
    )
    wait(
        lambda: js(
            driver,
            f"""
        const m = document.querySelectorAll('.msg.assistant');
        return m.length > {n_before} && !m[m.length - 1].classList.contains('streaming');
    """,
        ),
        what="the reply to finish streaming",
    )
    reply = js(driver, "const m = document.querySelectorAll('.msg.assistant'); "
                       "return m[m.length - 1].textContent")  # fmt: skip
    assert "[error" not in reply, reply
    if streamed:
        assert js(driver, "return window.__updates") >= 2, "the reply did not stream"
    return str(reply)


def test_web_view_end_to_end(
    server: Server, driver: Any, shots: Callable[[Any, str], Path]
) -> None:
    driver.get(server.url + "/")
    # No key: the key prompt, and no data on the page.
    wait(lambda: visible(driver, "key-panel"), what="the key prompt")
    assert not visible(driver, "main") and totals(driver) == {}
    time.sleep(0.5)
    assert severe_logs(driver) == []  # the page asked first: no refused request yet
    js(driver, "document.getElementById('key-input').value = 'wrong';"
               "document.getElementById('key-submit').click();")  # fmt: skip
    wait(lambda: "refused" in text(driver, "key-message"))
    assert not visible(driver, "main") and totals(driver) == {}
    shots(driver, "key")
    driver.get_log("browser")  # drop the expected 401s of the refused keys
    js(driver, f"document.getElementById('key-input').value = '{KEY}';"
               "document.getElementById('key-submit').click();")  # fmt: skip
    wait(lambda: visible(driver, "main") and totals(driver), what="the block map")
    assert totals(driver)["free"] == 96 and not visible(driver, "key-panel")

    # A chat message streams in; the usage line gives the cached-token split.
    chat(driver, SYSTEM + "When do you open?")
    cached_before = wait(lambda: totals(driver)["cached"], what="the reply's cached blocks")
    hit_before = hit_rate(driver)
    # Two requests sharing a (long) prefix: the second one hits it.
    chat(driver, "And on Sundays?", system=SYSTEM * 2)
    chat(driver, "Can I see the lamp room?", system=SYSTEM * 2)
    assert int(js(driver, "return document.getElementById('usage').dataset.cached")) > 0
    wait(lambda: hit_rate(driver) > hit_before, what="the hit rate to rise")
    wait(lambda: totals(driver)["cached"] > cached_before, what="more cached blocks")
    rows = js(driver, "return document.querySelectorAll('#requests tbody tr').length")
    assert rows >= 3
    shots(driver, "after-shared-prefix")

    # Pin the hottest prefix from the tree, then unpin it.
    button = "document.querySelector('#prefix-tree button.pin')"
    wait(lambda: js(driver, f"return !!{button}"), what="a prefix to pin")
    js(driver, f"{button}.click()")
    wait(lambda: js(driver, "return !!document.querySelector('#prefix-tree button.unpin')"),
         what="the pinned prefix")  # fmt: skip
    wait(lambda: totals(driver).get("pinned", 0) > 0, what="pinned blocks on the map")
    shots(driver, "pinned")
    js(driver, "document.querySelector('#prefix-tree button.unpin').click()")
    wait(lambda: totals(driver).get("pinned", 1) == 0, what="the pin to go")
    wait(lambda: not js(driver, "return !!document.querySelector('#prefix-tree button.unpin')"))
    assert severe_logs(driver) == []

    # Tools: a forced call (tool_choice required, one call: the grammar makes even the
    # random model call it), shown in the bubble and kept in the conversation's history.
    js(driver, "document.getElementById('clear').click();")  # a fresh conversation
    js(driver, f"document.getElementById('opt-tools').value = {json.dumps(json.dumps(TOOLS))};"
               "document.getElementById('opt-tool_choice').value = 'required';"
               "document.getElementById('opt-parallel_tool_calls').checked = false;")  # fmt: skip
    reply = chat(driver, "Is the museum open on Sunday?", max_tokens=80, streamed=False)
    raw = js(driver, "const m = document.querySelectorAll('.msg.assistant');"
                     "return m[m.length - 1].dataset.toolCalls || '[]'")  # fmt: skip
    (call,) = json.loads(raw)
    assert call["name"] == "opening_hours" and call["id"] and "→ opening_hours(" in reply
    assert json.loads(call["arguments"])["day"] in ("weekday", "sunday")
    js(driver, "document.getElementById('opt-tools').value = '';")
    chat(driver, "Thanks!")  # the next turn carries the call in its history
    assert severe_logs(driver) == []

    # A server restart: the page says the stream dropped, then reconnects on its own.
    server.stop()
    wait(lambda: "dropped" in text(driver, "notice")
         and visible(driver, "notice"), what="the drop notice")  # fmt: skip
    shots(driver, "dropped")
    server.start()
    wait(lambda: "reconnected" in text(driver, "notice"),
         timeout_s=30, what="the reconnect notice")  # fmt: skip
    wait(lambda: totals(driver).get("free") == 96, what="the new server's empty pool")
    errors = [m for m in severe_logs(driver) if "/v1/kv/state" not in m]  # the drop's own
    assert errors == []
