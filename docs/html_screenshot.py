"""Render a post-mortem's HTML report in headless Chromium and save a screenshot, to look at what users see.

    python docs/html_screenshot.py [DIR_OR_REPORT_JSON] [--out PNG] [--height PX]

DIR_OR_REPORT_JSON is a run directory (default: sample_runs/seed_adam), which is examined with the
post-mortem, or a saved JSON report, which is re-rendered. The HTML is written to a temporary folder
and opened from disk with networking off; the browser is Debian's ``chromium`` (``apt-get install -y
chromium``), or ``chromium-browser`` / ``google-chrome`` where those are on PATH. Prints the PNG's path.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
         "--hide-scrollbars")


def browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def screenshot(html: Path, png: Path, width: int = 1100, height: int = 2600, timeout: float = 60) -> Path:
    """``html`` opened from disk by headless Chromium, with a fresh profile, saved as ``png``."""
    exe = browser()
    if exe is None:
        raise FileNotFoundError(f"no headless browser found (looked for {', '.join(BROWSERS)})")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([exe, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                        f"--screenshot={png}", html.resolve().as_uri()],
                       check=True, capture_output=True, timeout=timeout)
    if not png.is_file():
        raise RuntimeError(f"{exe} wrote no screenshot")
    return png


def main() -> str | None:
    """The PNG's path printed; or, where no browser is installed or it fails, one line saying so (exit status 1)."""
    if browser() is None:  # before the post-mortem, which takes a while
        return (f"html_screenshot: no headless browser found (looked for {', '.join(BROWSERS)} on PATH); "
                "install one, e.g. apt-get install -y chromium")
    from nanforensics.postmortem import postmortem
    from nanforensics.saved import load_report
    from nanforensics.views.html import render_html

    root = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", type=Path, default=root / "sample_runs" / "seed_adam")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "nanforensics-report.png")
    parser.add_argument("--height", type=int, default=2600)
    args = parser.parse_args()
    report = load_report(args.source) if args.source.is_file() else postmortem(args.source)
    with tempfile.TemporaryDirectory() as folder:
        page = Path(folder) / "report.html"
        page.write_text(render_html(report), encoding="utf-8")
        try:
            print(screenshot(page, args.out, height=args.height))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            return f"html_screenshot: the browser failed: {e}"
    return None


if __name__ == "__main__":
    sys.exit(main())
