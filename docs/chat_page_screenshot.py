"""Take docs/chat-page.png: the chat page answering a question, in headless Chromium.

    python docs/chat_page_screenshot.py [--model MODEL] [--out docs/chat-page.png]

Starts `trio-mlx serve` (the bundled SmolLM2-135M-Instruct unless --model) on a free port, opens
the page in Debian's chromium (/usr/bin/chromium) through Playwright in the light colour scheme,
asks two questions with temperature 0 and saves a screenshot once the second answer has ended.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
]


def start_server(model: str | None) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "trio_mlx", "serve", "--port", "0"]
    if model:
        command.insert(4, model)
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    for line in process.stderr:
        if "listening on " in line:
            url = line.strip().split("listening on ", 1)[1]
            break
    else:
        raise SystemExit("trio-mlx serve ended before it listened")
    for _ in range(600):
        if httpx.get(url + "/health").status_code == 200:
            return process, url
        time.sleep(0.1)
    raise SystemExit("the model did not load within a minute")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default=str(Path(__file__).with_name("chat-page.png")))
    args = parser.parse_args()
    process, url = start_server(args.model)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium")
            page = browser.new_page(
                viewport={"width": 900, "height": 760}, color_scheme="light", device_scale_factor=1
            )
            page.goto(url)
            page.wait_for_selector("#model[data-ready]")
            page.click("#settings-toggle")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "160")
            page.click("#settings-toggle")
            for question in QUESTIONS:
                page.fill("#prompt", question)
                page.press("#prompt", "Enter")
                page.wait_for_selector(
                    ".message.assistant:last-of-type:not([data-state=streaming])", timeout=120_000
                )
            page.screenshot(path=args.out)
            browser.close()
    finally:
        process.terminate()
        process.wait(timeout=30)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
