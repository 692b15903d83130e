"""Headless Chromium driven over the Chrome DevTools protocol through a pipe
(`--remote-debugging-pipe`: commands in on fd 3, replies out on fd 4, each a JSON text ended by a
NUL byte), so the tests need no websocket client and no browser download."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tasks.lifetimes import bound_child, stop  # noqa: E402

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    return next((path for path in map(shutil.which, CANDIDATES) if path), None)


class Browser:
    def __init__(self, executable: str, profile: str, width: int = 1280, height: int = 1400,
                 log=subprocess.DEVNULL):
        commands_in, self._commands = os.pipe()
        self._replies, replies_out = os.pipe()
        # above 4, so that moving them to fds 3 and 4 cannot overwrite one with the other
        child_ends = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (commands_in, replies_out)]
        os.close(commands_in)
        os.close(replies_out)
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                 "--disable-background-networking", "--disable-component-update", "--hide-scrollbars",
                 "--mute-audio", f"--user-data-dir={profile}", f"--window-size={width},{height}",
                 "--remote-debugging-pipe", "about:blank"]
        exec_on_3_and_4 = ("import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
                           "os.execv(sys.argv[3], sys.argv[3:])")
        self.process = bound_child([sys.executable, "-c", exec_on_3_and_4, *map(str, child_ends),
                                    executable, *flags], pass_fds=child_ends,
                                   stdout=subprocess.DEVNULL, stderr=log)
        for fd in child_ends:
            os.close(fd)
        self._buffer, self._next = b"", 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def call(self, method: str, *, session: bool = False, timeout: float = 60, **params):
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buffer:
                text, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(text)
                if reply.get("id") == self._next:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                raise TimeoutError(f"chromium did not answer {method} within {timeout} s")
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium closed the pipe (exit status {self.process.poll()})")
            self._buffer += chunk

    def open(self, url: str) -> None:
        """Go to `url`, through a blank page, so what `wait_for` sees next is the new page's."""
        self.call("Page.navigate", session=True, url="about:blank")
        self.wait_for("document.URL === 'about:blank' && document.readyState === 'complete'", 30,
                      "a blank page")
        self.call("Page.navigate", session=True, url=url)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, seconds: float, what: str):
        deadline, value = time.monotonic() + seconds, None
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.5)
        text = self.evaluate("document.body ? document.body.innerText.slice(0, 1500) : null")
        raise TimeoutError(f"{what} did not happen within {seconds} s; the page says: {text!r}")

    def screenshot(self, path: str, full_page: bool = False) -> None:
        data = self.call("Page.captureScreenshot", session=True, format="png",
                         captureBeyondViewport=full_page)["data"]
        with open(path, "wb") as handle:
            handle.write(base64.b64decode(data))

    def close(self) -> None:
        for fd in (self._commands, self._replies):
            try:
                os.close(fd)
            except OSError:
                pass
        stop(self.process, grace=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
