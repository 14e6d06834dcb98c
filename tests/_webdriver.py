"""A headless Chromium driven through chromedriver's W3C WebDriver HTTP API (Debian's chromium-driver), for tests that click."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import signal
import subprocess
import urllib.error
import urllib.request
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: The W3C name of an element reference in WebDriver's JSON.
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"
#: How long a find waits for its element to appear (WebDriver's implicit wait), and a script to finish.
WAIT_MS = 20_000


class WebDriverError(RuntimeError):
    """An error WebDriver answered (its ``error`` code, e.g. ``stale element reference``, and message)."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(f"{error}: {message}")
        self.error = error


class Browser:
    """One headless Chromium session: open pages, find elements (waiting for them), click them, run scripts.

    Args:
        profile: A directory for the browser's profile (the test's tmp_path).
    """

    def __init__(self, profile: pathlib.Path) -> None:
        self._proc = subprocess.Popen([CHROMEDRIVER, "--port=0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True, start_new_session=True)
        try:
            assert self._proc.stdout is not None
            port = None
            for line in self._proc.stdout:  # "ChromeDriver was started successfully on port 43165."
                if "started successfully on port" in line:
                    port = int(line.rsplit(" ", 1)[1].rstrip(".\n"))
                    break
            if port is None:
                raise RuntimeError(f"chromedriver exited {self._proc.wait()} before it listened")
            self._base = f"http://127.0.0.1:{port}"
            args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    "--window-size=1200,1000", f"--user-data-dir={profile / 'chromium-profile'}"]
            caps = {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {"binary": CHROMIUM, "args": args}}}
            self._session = self._call("POST", "/session", {"capabilities": caps})["sessionId"]
            self._call("POST", f"/session/{self._session}/timeouts", {"implicit": WAIT_MS, "script": WAIT_MS})
        except BaseException:
            self._kill()
            raise

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self._base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json; charset=utf-8"})
        try:
            with urllib.request.urlopen(req, timeout=90) as r:
                return json.load(r)["value"]
        except urllib.error.HTTPError as e:
            value = json.load(e)["value"]
            raise WebDriverError(value.get("error", str(e.code)), value.get("message", "")) from None

    def _s(self, path: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        return self._call(method, f"/session/{self._session}{path}", body)

    def get(self, url: str) -> None:
        """Opens `url` (returns once the page has loaded)."""
        self._s("/url", {"url": url})

    def find(self, css: str) -> str:
        """The first element matching `css`, waiting up to WAIT_MS for one to appear."""
        return str(self._s("/element", {"using": "css selector", "value": css})[ELEMENT])

    def click(self, element: str) -> None:
        """Clicks the centre of `element` as a user would (scrolled into view)."""
        self._s(f"/element/{element}/click", {})

    def type(self, element: str, text: str) -> None:
        """Types `text` into `element` (a trailing ``\\ue007`` is Enter)."""
        self._s(f"/element/{element}/value", {"text": text})

    def click_at(self, element: str, dx: float, dy: float = 0.0) -> None:
        """Clicks (dx, dy) CSS pixels off the centre of `element`, as a mouse would (WebDriver's actions)."""
        mouse = [{"type": "pointerMove", "duration": 0, "origin": {ELEMENT: element}, "x": round(dx), "y": round(dy)},
                 {"type": "pointerDown", "button": 0}, {"type": "pointerUp", "button": 0}]
        self._s("/actions", {"actions": [{"type": "pointer", "id": "mouse", "parameters": {"pointerType": "mouse"},
                                          "actions": mouse}]})

    def clear(self, element: str) -> None:
        """Empties an input `element`."""
        self._s(f"/element/{element}/clear", {})

    def screenshot(self) -> bytes:
        """The window as a PNG."""
        return base64.b64decode(self._s("/screenshot", method="GET"))

    def script(self, body: str, *args: Any) -> Any:
        """Runs `body` (a function body: ``arguments`` holds `args`) in the page; its return value."""
        return self._s("/execute/sync", {"script": body, "args": list(args)})

    def close(self) -> None:
        """Ends the session and chromedriver (with every browser process it started)."""
        try:
            self._s("", method="DELETE")
        finally:
            self._kill()

    def _kill(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
