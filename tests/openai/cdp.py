"""Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe): no
websocket library, no driver download — Debian's `chromium` is all it needs."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _above(fd: int, floor: int = 10) -> int:
    """`fd` duplicated to a number >= floor (the original is closed)."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, floor)
    os.close(fd)
    return high


class Browser:
    """One headless browser with one page; every call has a timeout."""

    def __init__(self, binary: str, profile: Path, width: int = 1280, height: int = 900) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # --remote-debugging-pipe reads commands on fd 3 and writes replies on fd 4: the child moves
        # its pipe ends there (first lifted above 4, so that moving one cannot clobber the other).
        to_browser_r, from_browser_w = _above(to_browser_r), _above(from_browser_w)
        self._proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(3, 4),
            preexec_fn=lambda: (os.dup2(to_browser_r, 3), os.dup2(from_browser_w, 4)),
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self._session: str | None = None

    def command(self, method: str, timeout: float = 15.0, **params):
        """Sends one DevTools command (to the page once attached) and returns its result."""
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params}
        if self._session and not method.startswith("Target."):
            msg["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply["result"]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reply to {method} within {timeout}s")
            ready, _, _ = select.select([self._from_browser], [], [], 0.5)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError("the browser exited")
                self._buffer += chunk

    def open(self, url: str) -> None:
        target = self.command("Target.createTarget", url=url)["targetId"]
        self._session = self.command("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def evaluate(self, expression: str):
        result = self.command("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        data = self.command("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            os.close(self._to_browser)
            os.close(self._from_browser)
        except OSError:
            pass
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
