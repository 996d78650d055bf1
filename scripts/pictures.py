"""The README's two pictures of the seed sample, regenerated, and the headless Chromium that draws any HTML report.

    python -m scripts.pictures                  # docs/images/report.png and docs/images/terminal.svg
    python scripts/pictures.py --html SOURCE --out PNG   # any report: a run directory or a saved JSON report

report.png is the HTML report of ``nanforensics postmortem sample_runs/seed_adam --html``, as Chromium draws it;
terminal.svg is the terminal report of ``nanforensics replay sample_runs/seed_adam``, as rich records it
(``Console(record=True).export_svg``). Both run from the repository root, so the paths they show are relative.

Chromium is Debian's ``chromium`` (``apt-get install -y chromium``; ``chromium-browser`` or ``google-chrome``
where those are on PATH), driven over the DevTools protocol through a pipe (``--remote-debugging-pipe``): no
package beyond the standard library, no port opened. Every request the page makes but its own file is refused and
recorded, and so are console messages, errors and dialogs: tests/test_browser.py asserts there are none.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
SEED = Path("sample_runs") / "seed_adam"  # relative to ROOT: the paths the pictures show are the user's
IMAGES = ROOT / "docs" / "images"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# headless, a fresh profile, nothing fetched on the browser's own behalf; no sandbox: CI runs as root
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
         "--disable-extensions", "--disable-sync", "--disable-component-update", "--hide-scrollbars",
         "--host-resolver-rules=MAP * ~NOTFOUND", "--remote-debugging-pipe")
WIDTH = 1100
TERMINAL_COLUMNS = 100
# What the SVG depends on besides the code: the CPU the replay ran on (its findings name it) and rich's SVG writer
SVG_HEADER = ("<!-- nanforensics replay {run}: replayed on {cpu}, drawn by rich {rich}; "
              "regenerate: python -m scripts.pictures -->\n")


def browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


@dataclass
class Visit:
    """What a page did while it loaded: every event a test asserts on, as the browser reported it."""

    url: str
    requests: list[str] = field(default_factory=list)  # every URL but the page's own (those Fetch sees, refused)
    console: list[str] = field(default_factory=list)  # console messages of level error or warning, log entries too
    errors: list[str] = field(default_factory=list)  # uncaught exceptions
    dialogs: list[str] = field(default_factory=list)  # alert(), confirm(), prompt(): a script ran


class Chromium:
    """One headless Chromium, opened once and reused for many pages (a launch costs about a second)."""

    def __init__(self, timeout: float = 60) -> None:
        exe = browser()
        if exe is None:
            raise FileNotFoundError(f"no headless browser found (looked for {', '.join(BROWSERS)} on PATH); "
                                    "install one, e.g. apt-get install -y chromium")
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory()
        to_browser, self._theirs_in = os.pipe()
        self._theirs_out, from_browser = os.pipe()
        self._write, self._read = self._theirs_in, self._theirs_out

        def pipes() -> None:  # the protocol's descriptors: the browser reads 3 and writes 4 (by way of free numbers)
            os.dup2(to_browser, 100)
            os.dup2(from_browser, 101)
            os.dup2(100, 3)
            os.dup2(101, 4)

        self.process = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={self._profile.name}", "about:blank"],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        preexec_fn=pipes, pass_fds=(3, 4))
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next_id = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._pages: dict[str, Page] = {}  # by session: each event is noted by its page as it arrives

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for fd in (self._write, self._read):
            os.close(fd)
        self._profile.cleanup()

    # ---- the protocol: JSON messages, each ended by a NUL byte --------------------------------------------

    def call(self, method: str, params: Optional[dict[str, Any]] = None, session: Optional[str] = None) -> dict[str, Any]:
        """The result of one command; the events that arrive before it are handed to their pages (a paused request
        answered at once: a navigation waits for it)."""
        self._next_id += 1
        ident = self._next_id
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        while ident not in self._replies:
            self._pump()
        reply = self._replies.pop(ident)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    def _pump(self) -> None:
        """One message handled: a reply kept for its call (one made meanwhile, by a page's event, may come first),
        an event handed to its page."""
        message = self._receive()
        page = self._pages.get(message.get("sessionId", ""))
        if "id" in message:
            self._replies[message["id"]] = message
        elif page is not None:
            page.record(message)

    def _receive(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise TimeoutError(f"the browser sent nothing for {self.timeout:g} s")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise RuntimeError("the browser closed its pipe")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    # ---- pages ------------------------------------------------------------------------------------------------

    def open(self, html: Path) -> Page:
        """``html`` loaded from disk in a new tab: every request but its own refused, and the visit recorded."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = self._pages[session] = Page(self, session, target, Visit(html.resolve().as_uri()))
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=session)
        self.call("Fetch.enable", {"patterns": [{"urlPattern": "*"}]}, session=session)
        self.call("Emulation.setDeviceMetricsOverride", {"width": WIDTH, "height": 800, "deviceScaleFactor": 1,
                                                         "mobile": False}, session=session)
        self.call("Page.navigate", {"url": page.visit.url}, session=session)
        while not page.loaded:
            self._pump()
        return page


@dataclass
class Page:
    browser: Chromium
    session: str
    target: str
    visit: Visit
    loaded: bool = False

    def record(self, event: dict[str, Any]) -> None:
        """One event of the page noted in its ``visit`` (a paused request answered, a dialog dismissed)."""
        method, params = event["method"], event.get("params", {})
        if method == "Network.requestWillBeSent" and params["request"]["url"] != self.visit.url:
            self.visit.requests.append(params["request"]["url"])  # any scheme, file: and data: too
        elif method == "Fetch.requestPaused":  # http(s): refused
            own = params["request"]["url"] == self.visit.url
            self.browser.call("Fetch.continueRequest" if own else "Fetch.failRequest",
                              {"requestId": params["requestId"], **({} if own else {"errorReason": "BlockedByClient"})},
                              session=self.session)
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "warning", "assert"):
            self.visit.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
            self.visit.console.append(params["entry"]["text"])
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.visit.errors.append(details.get("exception", {}).get("description") or details.get("text", ""))
        elif method == "Page.javascriptDialogOpening":
            self.visit.dialogs.append(params["message"])
            self.browser.call("Page.handleJavaScriptDialog", {"accept": False}, session=self.session)
        elif method == "Page.loadEventFired":
            self.loaded = True

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (the test's, never the page's own: it has none)."""
        result = self.browser.call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                                   session=self.session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:60]}...: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def settle(self) -> Visit:
        """The visit, with the events sent before now (a late console message) noted too."""
        self.evaluate("0")  # a round trip: whatever the page reported before it has been received
        return self.visit

    def screenshot(self, scale: float = 1) -> bytes:
        """The whole page as a PNG, ``WIDTH * scale`` pixels wide (in front: a tab behind others is not drawn)."""
        self.browser.call("Page.bringToFront", session=self.session)
        height = self.evaluate("Math.ceil(document.documentElement.scrollHeight)")
        return base64.b64decode(self.browser.call("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": WIDTH, "height": height, "scale": scale}}, session=self.session)["data"])

    def close(self) -> None:
        self.browser.call("Target.closeTarget", {"targetId": self.target})
        del self.browser._pages[self.session]


def screenshot(html: Path, png: Path) -> Path:
    """``html`` opened from disk by headless Chromium and saved as ``png``."""
    with Chromium() as chromium:
        png.write_bytes(chromium.open(html).screenshot())
    return png


# ---- the pictures ------------------------------------------------------------------------------------------


def report_html() -> str:
    """The seed sample's post-mortem as HTML, examined from the repository root (run with cwd = ROOT)."""
    from nanforensics.postmortem import postmortem
    from nanforensics.views.html import render_html

    return render_html(postmortem(SEED))


def seed_replay() -> Any:
    """``nanforensics replay sample_runs/seed_adam``'s report, on the CPU (run with cwd = ROOT)."""
    from nanforensics.replay.engine import ReplayOptions, replay_run

    return replay_run(SEED, ReplayOptions(device="cpu"))


def terminal_svg(report: Any) -> str:
    """The replay's terminal report as the CLI draws it, recorded by rich as SVG in a monospace font of the reader's
    (rich's own template loads Fira Code from a CDN: the picture fetches nothing, as the HTML report does). A first
    comment names what the picture depends on besides the code (``SVG_HEADER``)."""
    from importlib.metadata import version

    from nanforensics.runs.cpu import describe as describe_cpu
    from nanforensics.views.replay import render_terminal
    from rich._export_format import CONSOLE_SVG_FORMAT
    from rich.console import Console

    console = Console(record=True, width=TERMINAL_COLUMNS, file=io.StringIO(), force_terminal=True,
                      color_system="truecolor", highlight=False, emoji=False, legacy_windows=False)
    render_terminal(report, console)
    header = SVG_HEADER.format(run=SEED, cpu=describe_cpu(report.setup.replay_cpu), rich=version("rich"))
    template = re.sub(r"@font-face \{\{.*?\}\}\s*", "", CONSOLE_SVG_FORMAT, flags=re.S)
    return header + console.export_svg(title=f"nanforensics replay {SEED}", code_format=template)


def main() -> str | None:
    """The pictures written (their paths printed); or one line saying why not (exit status 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--html", type=Path, metavar="SOURCE",
                        help="a run directory (examined by the post-mortem) or a saved JSON report: screenshot it")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "nanforensics-report.png")
    args = parser.parse_args()
    if browser() is None:  # before the post-mortem, which takes a while
        return f"pictures: no headless browser found (looked for {', '.join(BROWSERS)} on PATH); " \
               "install one, e.g. apt-get install -y chromium"
    source, out = (args.html.resolve() if args.html else None), args.out.resolve()  # the caller's, before the cd
    os.chdir(ROOT)
    from nanforensics.errors import BadInput
    from nanforensics.views.escaping import visible

    try:
        if source is not None:
            from nanforensics.postmortem import postmortem
            from nanforensics.saved import load_report
            from nanforensics.views.html import render_html

            html, png, svg = render_html(load_report(source) if source.is_file() else postmortem(source)), out, None
        else:
            html, png, svg = report_html(), IMAGES / "report.png", terminal_svg(seed_replay())
    except BadInput as e:
        return f"pictures: {visible(str(e))}"  # a file's name on one line, as the CLI writes it
    with tempfile.TemporaryDirectory() as folder:
        page = Path(folder) / "report.html"
        page.write_text(html, encoding="utf-8")
        try:
            screenshot(page, png)
        except (OSError, RuntimeError, TimeoutError) as e:
            return f"pictures: the browser failed: {e}"
    print(png)
    if svg is not None:
        (IMAGES / "terminal.svg").write_text(svg, encoding="utf-8")
        print(IMAGES / "terminal.svg")
    return None


if __name__ == "__main__":
    sys.exit(main())
