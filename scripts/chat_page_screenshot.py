"""Screenshot the chat page mid-answer: docs/ui/chat-page.png.

Writes a small synthetic model (12 layers x 32 experts, random weights: the text is noise),
serves it with a RAM budget of a third of its experts, asks questions in headless Chromium
(Debian's ``chromium`` and ``chromium-driver``, driven by Selenium) and saves the page while
an answer streams (the model may end one early: then it asks the next question), so the
expert map and its recent activity are live.

    python scripts/chat_page_screenshot.py [OUT.png]
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from gguf_tools.synth import SynthSpec, write_synthetic_model

ROOT = Path(__file__).resolve().parents[1]
SPEC = SynthSpec(arch="qwen3moe", layers=12, experts=32, top_k=4, embd=64, ff=32,
                 dtype="f32", seed=0, skew=1.0)


def serve(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """Start ``moe-offload serve`` on a free port; (process, base URL) once it is ready."""
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "-m", str(model),
                             "--port", "0", "-c", "8192", "--devices.cpu", "3MiB"],
                            cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        match = re.search(r"listening on (http://[^\s]+)", log.read_text(errors="replace"))
        if match:
            try:
                if httpx.get(match.group(1) + "/health", timeout=2).status_code == 200:
                    return proc, match.group(1)
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"the server did not start:\n{log.read_text(errors='replace')}")


def ask(driver, text: str) -> None:
    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "ui" / "chat-page.png"
    with tempfile.TemporaryDirectory() as tmp:
        model = write_synthetic_model(Path(tmp) / "synthetic-moe.gguf", SPEC)
        proc, base = serve(model, Path(tmp) / "serve.log")
        options = Options()
        options.binary_location = "/usr/bin/chromium"
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                    "--window-size=1400,860", "--hide-scrollbars"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            driver.get(base + "/")
            driver.execute_script("localStorage.setItem('moe-offload-settings', JSON.stringify("
                                  "{max_tokens: '120', temperature: '0.7', top_p: '0.95'}))")
            driver.get(base + "/")
            wait = WebDriverWait(driver, 60, poll_frequency=0.05)
            wait.until(lambda d: d.find_element(By.ID, "heatmap").get_attribute("data-routed"))
            questions = ["Which experts does a short question wake up?",
                         "And a longer one: tell me about the sea.",
                         "Tell me more, with a list.", "Go on.", "Once more, at length.",
                         "Why?", "Say it differently.", "And then?", "Explain it slowly."]
            out.parent.mkdir(parents=True, exist_ok=True)
            ask(driver, questions[0])    # one finished answer: its speed and expert cost
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .experts"))
            driver.execute_script("document.getElementById('max_tokens').value = '3000'")
            for text in questions[1:]:  # then until an answer still streams a moment in
                ask(driver, text)
                shots, started = 0, time.monotonic()
                # the page as late as 3 s into the answer, while it still streams
                while time.monotonic() - started < 3.0:
                    time.sleep(0.3)
                    png = driver.get_screenshot_as_png()
                    if not driver.find_element(By.ID, "stop").is_displayed():
                        break
                    out.write_bytes(png)
                    shots += 1
                if shots >= 2:
                    break
                wait.until(lambda d: d.find_element(By.ID, "send").is_displayed())
            else:
                sys.exit("every answer ended too soon for a screenshot; run again")
            print(f"wrote {out}")
        finally:
            driver.quit()
            proc.terminate()
            proc.wait(timeout=15)


if __name__ == "__main__":
    main()
