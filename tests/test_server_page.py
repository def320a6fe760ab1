"""The chat page at / in headless Chromium (Debian's `chromium`, driven by Playwright): a
streamed answer appears, the next turn carries the history, and Stop cancels a generation."""

from __future__ import annotations

import json
import shutil

import pytest
from server_util import FOREVER, health, long_llm, metric, serving, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def page(tiny_cflow):
    from playwright.sync_api import sync_playwright

    assert CHROMIUM, "install Debian's chromium (apt-get install -y chromium); see README.md"
    # the long-context tiny model: an answer of FOREVER tokens runs until Stop ends it
    with serving(long_llm(tiny_cflow)) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        p = browser.new_page()
        p.set_default_timeout(180_000)  # generous: CI machines can be slow and shared
        p.goto(url + "/")
        p.url_base = url
        yield p
        browser.close()


def test_page_streams_an_answer_and_keeps_history(page, tiny_llm):
    page.wait_for_function("document.getElementById('model').textContent.includes('context')")
    assert "tiny-llama" in page.inner_text("#model")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "24")
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/chat/completions") else None)

    page.fill("#prompt", "What is the capital of France?")
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").nth(0)
    page.wait_for_function("document.querySelectorAll('.msg.assistant .text')[0]?.textContent.length > 0")
    page.wait_for_selector(".msg.assistant .stats:has-text('decode')")  # the server's speed, at the end
    assert answer.locator(".text").text_content()
    assert "tok/s" in answer.locator(".stats").inner_text()
    assert page.is_enabled("#send") and not page.is_enabled("#stop")

    page.fill("#frequency_penalty", "0.5")  # the penalties are sent when given, left out when empty
    page.fill("#prompt", "And of Italy?")
    page.click("#send")
    page.wait_for_selector(".msg.assistant >> nth=1 >> .stats:has-text('decode')")
    assert [m["role"] for m in bodies[1]["messages"]] == ["user", "assistant", "user"]
    assert bodies[1]["messages"][1]["content"] == answer.locator(".text").text_content()
    assert bodies[1]["stream"] is True and bodies[1]["temperature"] == 0
    assert "frequency_penalty" not in bodies[0] and bodies[1]["frequency_penalty"] == 0.5
    assert "presence_penalty" not in bodies[1]
    page.fill("#frequency_penalty", "")


def test_stop_button_cancels_the_generation(page):
    url = page.url_base
    page.click("#clear")  # a new chat
    assert page.locator(".msg").count() == 0
    page.fill("#temperature", "0")
    page.fill("#max_tokens", str(FOREVER))  # an answer that ends only when Stop ends it
    page.fill("#prompt", "Tell me a very long story.")
    # Click Stop from a DOM observer that runs as soon as the first piece of the answer is on the
    # page (a polling wait from here would starve the page's own work on a busy machine).
    page.evaluate("""() => {
        window.stopOutcome = new Promise((resolve) => {
          const seen = new MutationObserver(() => {
            const texts = document.querySelectorAll('.msg.assistant .text');
            if (!texts.length || !texts[texts.length - 1].textContent) return;
            seen.disconnect();
            const stop = document.getElementById('stop');
            if (stop.disabled) return resolve('finished before Stop could be clicked');
            stop.click();
            resolve('clicked');
          });
          seen.observe(document.getElementById('log'), { subtree: true, childList: true, characterData: true });
        });
      }""")
    page.click("#send")
    outcome = page.evaluate("window.stopOutcome")
    assert outcome == "clicked"
    page.wait_for_selector(".msg.assistant .stats:has-text('stopped')")
    assert page.is_enabled("#send") and not page.is_enabled("#stop")

    wait_for(lambda: health(url)["active"] == 0, what="the generation to stop")
    assert metric(url, "cflow_generations_cancelled_total") >= 1
    assert metric(url, "cflow_completion_tokens_total") < FOREVER  # the stopped answer never completed


def test_the_json_box_asks_for_json_mode_and_the_answer_is_json(page, tiny_llm):
    from cflow.structured import follow, grammar

    page.click("#clear")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "40")
    page.check("#json_mode")
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/chat/completions") else None)
    page.fill("#prompt", "A JSON object, please.")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant .stats:has-text('decode')")
    assert bodies[-1]["response_format"] == {"type": "json_object"}
    text = page.locator(".msg.assistant .text").nth(0).text_content()
    assert "{" in text and follow(tiny_llm.tokenizer, grammar(json_object=True), text) is not None  # or its start
    # a schema in the schema box: the answer follows it
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    page.fill("#json_schema", json.dumps(schema))
    page.fill("#prompt", "A number, please.")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant >> nth=1 >> .stats:has-text('decode')")
    assert bodies[-1]["response_format"] == {"type": "json_schema", "json_schema": {"name": "page", "schema": schema}}
    text = page.locator(".msg.assistant .text").nth(1).text_content()
    assert follow(tiny_llm.tokenizer, grammar(json_schema=schema), text) is not None  # the schema's text, or its start
    # a schema that is not JSON: an error on the page, and nothing sent
    sent = len(bodies)
    page.fill("#json_schema", "{nope")
    page.fill("#prompt", "Again.")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.error:has-text('not JSON')")
    assert len(bodies) == sent
    page.reload()  # the box and the schema are kept, as the other settings are
    assert page.is_checked("#json_mode") and page.input_value("#json_schema") == "{nope"
    page.fill("#json_schema", "")
    page.uncheck("#json_mode")
