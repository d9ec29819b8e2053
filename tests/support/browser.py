"""Real headless Chromium (Debian's `chromium`), driven over the Chrome DevTools Protocol.

One browser process per `Browser`, with a fresh profile in a temporary directory, no network of
its own (no updates, no sync) and DevTools on a loopback port it picks itself; one page, spoken
to over its websocket. Exceptions the page's scripts throw are collected, so a test can assert
there were none.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket

CHROMIUM = "chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0")


class Browser:
    def __init__(self, width: int = 1280, height: int = 900):
        self.size = (width, height)
        self.errors: list[str] = []
        self._ids = itertools.count(1)

    def __enter__(self) -> Browser:
        binary = shutil.which(CHROMIUM)
        assert binary, "chromium is not installed: `make system-tools` installs it (apt-get install chromium)"
        # Chromium's helper processes may still write into the profile as they die: never fail on it.
        self.profile = tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True)
        # A session of its own, so that stopping it stops its helper processes too.
        self.process = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile.name}",
                                         f"--window-size={self.size[0]},{self.size[1]}", "about:blank"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            port = self._devtools_port()
            targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
            page = next(t for t in targets if t["type"] == "page")
            self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30,
                                                  suppress_origin=True)
            for domain in ("Page", "Runtime"):
                self.send(f"{domain}.enable")
            self.send("Emulation.setDeviceMetricsOverride", width=self.size[0], height=self.size[1],
                      deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(10)
        self.profile.cleanup()

    def _devtools_port(self, timeout: float = 30) -> int:
        """Chromium writes the port it listens on into the profile once DevTools is up."""
        marker = Path(self.profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"chromium exited with status {self.process.returncode}"
            if marker.is_file() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            time.sleep(0.05)
        raise AssertionError(f"chromium's DevTools did not come up within {timeout:.0f} s")

    # ------------------------------------------------------------ protocol
    def send(self, method: str, **params: Any) -> dict:
        """Call `method` and return its result; events that arrive meanwhile are noted."""
        call = next(self._ids)
        self.ws.send(json.dumps({"id": call, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("method") == "Runtime.exceptionThrown":
                details = message["params"]["exceptionDetails"]
                self.errors.append((details.get("exception") or {}).get("description") or details.get("text", ""))
            if message.get("id") == call:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", timeout=30)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails'].get('exception', {}).get('description')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, period: float = 0.2) -> Any:
        """Until `expression` is truthy in the page; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            assert time.monotonic() < deadline, f"not true in the page within {timeout:.0f} s: {expression}"
            time.sleep(period)

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """A PNG of the page (all of it when `full_page`)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            width, height = self.evaluate("[document.documentElement.scrollWidth, "
                                          "document.documentElement.scrollHeight]")
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", **params)["data"]))
        return path
