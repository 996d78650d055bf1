"""Every HTML page the tool writes, opened by headless Chromium with networking off, as a user opens the file.

The pages: ``postmortem --html`` of a recorded run (the seed sample) and of a folder of checkpoints alone; ``report
--html`` of a saved replay, bisection (alone, and with the replay ``bisect --code`` adds) and post-mortem; a run
named by an attacker (tests/hostile_names.py) examined by ``postmortem --html`` from a folder whose name cannot
break; and its saved report with a script, then a word too long for any line, in every string it holds. (``scan``
writes no HTML.) Each page is checked for what the browser reports (no request, console message, error or dialog),
for what its DOM holds (the key figures visible, as the report's own JSON states them; run text as text), for its
width (no sideways scrolling), and drawn.

One Chromium per module (scripts/pictures.py's driver: the DevTools protocol over a pipe), its pages opened once.
Where no Chromium is installed the tests skip, but not under CI (``CI`` set), which installs it (.ci/run).
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nanforensics.saved import load_report
from nanforensics.views.html import render_html

import hostile_names
from conftest import ROOT, run_cli

_spec = importlib.util.spec_from_file_location("pictures", ROOT / "scripts" / "pictures.py")
pictures = sys.modules["pictures"] = importlib.util.module_from_spec(_spec)  # registered: it defines dataclasses
_spec.loader.exec_module(pictures)

# A script three ways: an element, an event handler on an element that fails to load, one on an element that loads
PAYLOAD = ("<script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\">"
           "<svg onload=\"window.__pwned=3\"></svg>")
UNBROKEN = "_".join(["checkpoint"] * 20)  # 219 characters where no line may break
SEED = ROOT / "sample_runs" / "seed_adam"

# The rows of every two-cell table (the facts): label -> the value's rendered text, and whether a reader sees it
FACTS_JS = """(() => {
  const seen = el => { const r = el.getBoundingClientRect();
    return el.checkVisibility({opacityProperty: true, visibilityProperty: true}) && r.width > 0 && r.height > 0
      && r.left >= 0 && r.right <= window.innerWidth; };
  const out = {};
  for (const tr of document.querySelectorAll("tr")) {
    const cells = tr.querySelectorAll("th, td");
    if (cells.length === 2 && cells[0].tagName === "TH")
      out[cells[0].textContent.trim()] = {text: cells[1].innerText, visible: seen(cells[1])};
  }
  return out;
})()"""
# What could run: script elements, event-handler attributes, javascript: URLs, and the globals the payloads set
ACTIVE_JS = """(() => ({
  scripts: document.querySelectorAll("script").length,
  handlers: [...document.querySelectorAll("*")].flatMap(el => [...el.attributes].map(a => a.name))
    .filter(n => n.startsWith("on")),
  urls: [...document.querySelectorAll("[href], [src], [action], [formaction]")].length,
  pwned: typeof window.__pwned,
}))()"""


@pytest.fixture(scope="module")
def chromium():
    if pictures.browser() is None:
        if os.environ.get("CI"):
            pytest.fail("CI has no headless Chromium: .ci/run installs it (apt-get install -y chromium)")
        pytest.skip("no headless Chromium here (apt-get install -y chromium)")
    with pictures.Chromium() as browser:
        yield browser


def _written(result: Any, *paths: Path) -> None:
    assert result.code in (0, 1), result.stderr  # 1: found
    assert all(p.is_file() for p in paths), result.stderr


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Every page, by name, with the JSON report it was rendered from (the CLI's own, saved beside it)."""
    root = tmp_path_factory.mktemp("pages")
    out: dict[str, tuple[Path, dict[str, Any]]] = {}

    def cli(name: str, *args: str | Path, cwd: Path | None = None) -> dict[str, Any]:
        html, saved = root / f"{name}.html", root / f"{name}.json"
        _written(run_cli(*args, "--html", html, "--json", saved, "--quiet", cwd=cwd), html, saved)
        out[name] = html, json.loads(saved.read_text(encoding="utf-8"))
        return out[name][1]

    def rerender(name: str, report: dict[str, Any]) -> None:
        saved, html = root / f"{name}.json", root / f"{name}.html"
        saved.write_text(json.dumps(report), encoding="utf-8")
        _written(run_cli("report", saved, "--html", html), html)
        out[name] = html, report

    # from the repository root, as the README runs it: the run's code is found by its relative import strings
    seed = cli("postmortem", "postmortem", SEED.relative_to(ROOT), cwd=ROOT)
    rerender("report-postmortem", seed)
    rerender("report-replay", seed["replay"])  # what `replay --json` writes: the post-mortem's replay is that report
    bisected = root / "bisect.json"
    _written(run_cli("bisect", SEED, "--json", bisected, "--quiet"), bisected)
    bisect = json.loads(bisected.read_text(encoding="utf-8"))
    rerender("report-bisect", bisect)
    # what `bisect --code` writes: the bisection, then the replay from its last clean checkpoint (here the seed's)
    rerender("report-bisect-replayed", {**bisect, "replayed": seed["replay"]})
    cli("postmortem-checkpoints", "postmortem", SEED / "checkpoints")
    # in a folder named as experiments are: 90 characters and nowhere a line may break
    deep = root / "llama7b_lr3e4_warmup2000_bs512_seed17_fp16_zero3_gradclip1_run000042_resumed_from_step_12000"
    hostile = cli("hostile", "postmortem", hostile_names.record(deep / "hostile-run"))
    spelled = root / "spelled.html"  # every string of the saved report with the payload appended (views' input)
    spelled.write_text(render_html(hostile_names.appended(load_report(root / "hostile.json"), PAYLOAD)), encoding="utf-8")
    out["spelled"] = spelled, hostile
    unbroken = root / "unbroken.html"  # ... and with a word too long for any line
    unbroken.write_text(render_html(hostile_names.appended(load_report(root / "hostile.json"), UNBROKEN)), encoding="utf-8")
    out["unbroken"] = unbroken, hostile
    return out


@pytest.fixture(scope="module")
def pages(chromium, written) -> dict[str, Any]:
    """Each page opened once, its visit recorded and its DOM read."""
    out = {}
    for name, (html, report) in written.items():
        page = chromium.open(html)
        out[name] = {"visit": page.settle(), "facts": page.evaluate(FACTS_JS), "active": page.evaluate(ACTIVE_JS),
                     "text": page.evaluate("document.body.textContent"),
                     "width": page.evaluate("document.documentElement.scrollWidth"),
                     "head": page.evaluate("document.querySelector('h1').innerText"),
                     "headings": page.evaluate("[...document.querySelectorAll('h1, h2')].map(h => h.innerText).join('\\n')"),
                     "report": report}
        page.close()
    return out


NAMES = ["postmortem", "report-postmortem", "report-replay", "report-bisect", "report-bisect-replayed",
         "postmortem-checkpoints", "hostile", "spelled", "unbroken"]


@pytest.mark.parametrize("name", NAMES)
def test_the_page_fetches_nothing_logs_nothing_runs_nothing_and_fits_the_window(pages, name):
    p = pages[name]
    visit = p["visit"]
    assert (visit.requests, visit.console, visit.errors, visit.dialogs) == ([], [], [], [])
    assert p["active"] == {"scripts": 0, "handlers": [], "urls": 0, "pwned": "undefined"}
    assert p["width"] <= pictures.WIDTH  # no sideways scrolling: a long unbroken string wraps


def _replay_of(report: dict[str, Any]) -> dict[str, Any]:
    """The replay a saved report holds: itself, a post-mortem's ``replay``, or what ``bisect --code`` ``replayed``."""
    kind = report["schema"].split("/")[0]
    return report if kind == "nanforensics.replay" else report["replay" if kind == "nanforensics.postmortem" else "replayed"]


@pytest.mark.parametrize("name", ["postmortem", "report-postmortem", "report-replay", "report-bisect-replayed", "hostile"])
def test_the_responsible_step_origin_and_samples_are_shown_as_the_report_states_them(pages, name):
    p = pages[name]
    facts, replay = p["facts"], _replay_of(p["report"])
    batch, origin, samples = replay["responsible_batch"], replay["origin"], replay["samples"]
    assert all(facts[label]["visible"] for label in ("responsible batch", "origin", "samples"))
    shown = {label: facts[label]["text"] for label in ("responsible batch", "origin", "samples")}
    assert shown["responsible batch"].startswith(f"step {batch['step']}, ")
    assert shown["origin"].startswith(f"step {origin['step']}, ") and f"({origin['dtype']})" in shown["origin"]
    assert shown["samples"].startswith(f"{', '.join(map(str, samples['samples']))} of {samples['batch_size']}")
    if name != "hostile":  # run text as it is (the hostile run's is shown escaped: the next test)
        assert p["report"].get("headline", replay["headline"]) in p["headings"]  # a bisection's has none: its replay's
        assert batch["file"] in shown["responsible batch"] and origin["text"] in shown["origin"]
        assert all(f"{key} = {value}" in shown["samples"] for key, value in samples["sample_leaves"].items())


@pytest.mark.parametrize("name", ["report-bisect", "report-bisect-replayed", "postmortem-checkpoints"])
def test_the_first_poisoned_and_last_clean_checkpoints_are_shown_as_the_report_states_them(pages, name):
    report = pages[name]["report"]
    bisected = report if name.startswith("report-bisect") else report["checkpoints"]
    facts = pages[name]["facts"]
    for label, key in (("first poisoned", "first_poisoned"), ("last clean", "last_clean")):
        ref = bisected[key]
        assert facts[label]["visible"] and facts[label]["text"] == f"step {ref['step']}: {ref['path']}"
    if name == "postmortem-checkpoints":  # no replay: the origin bracketed by the two
        window = report["window"]
        assert facts["origin window"]["visible"]
        assert facts["origin window"]["text"].startswith(f"in steps {window['first']}-{window['last']}: ")


def test_a_run_named_by_an_attacker_is_shown_as_text(pages):
    text = pages["hostile"]["text"]
    assert "<script>alert(1)</script><img src=x onerror=alert(1)>&amp;" in text  # the markup, as characters
    assert "[red]x[/red][link=https://evil]y[/link]" in text
    assert "\x1b" not in text and "\\x1b]0;pwned\\x07" in text  # escape sequences made visible, not sent


def test_every_string_of_the_report_holding_a_script_is_shown_as_text(pages):
    p = pages["spelled"]
    assert p["text"].count(PAYLOAD) >= 20 and p["head"].endswith(PAYLOAD)
    assert {label for label, v in p["facts"].items() if PAYLOAD not in v["text"]} == {"read"}  # counts, no text


# ---- pictures ------------------------------------------------------------------------------------------------


def png_pixels(png: bytes, limit: int | None = None) -> np.ndarray:
    """The pixels (height x width x channels) of an 8-bit, non-interlaced PNG, what Chromium writes (no Pillow);
    ``limit``: its first rows only (a Paeth-filtered row is decoded byte by byte)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = {}, 8
    while at < len(png):
        size, kind = struct.unpack(">I4s", png[at:at + 8])
        chunks[kind] = chunks.get(kind, b"") + png[at + 8:at + 8 + size]
        at += 12 + size
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert depth == 8 and interlace == 0 and colour in (0, 2, 4, 6)
    n = {0: 1, 2: 3, 4: 2, 6: 4}[colour]
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(height, width * n + 1)[:limit]
    height = len(rows)
    out = np.zeros((height + 1, width * n), np.int64)  # out[0]: the row before the first, zeros
    for y, (kind, line) in enumerate(zip(rows[:, 0], rows[:, 1:].astype(np.int64)), 1):
        up = out[y - 1]
        if kind in (0, 2):  # none, up
            out[y] = (line + (up if kind == 2 else 0)) % 256
        elif kind == 1:  # sub: a running sum per channel
            out[y] = line.reshape(width, n).cumsum(axis=0).reshape(-1) % 256
        else:  # average, Paeth: byte by byte, each on the one to its left
            for x in range(width * n):
                a, b, c = (out[y, x - n], up[x], up[x - n]) if x >= n else (0, up[x], 0)
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                out[y, x] = (line[x] + ((a + b) // 2 if kind == 3 else a if pa <= pb and pa <= pc else
                                        b if pb <= pc else c)) % 256
    return out[1:].reshape(height, width, n)


def _drawn(chromium: Any, html: Path, scale: float) -> bytes:
    page = chromium.open(html)
    try:
        return page.screenshot(scale=scale)
    finally:
        page.close()


def test_the_seed_report_is_drawn_and_not_blank(chromium, written, tmp_path):
    blank = tmp_path / "blank.html"
    blank.write_text("<!doctype html><title>blank</title>", encoding="utf-8")
    drawn, empty = (png_pixels(_drawn(chromium, page, scale=0.25)) for page in (written["postmortem"][0], blank))
    assert empty.var() == 0  # the measure tells a blank page (a quarter of the size: decoded faster)
    height, width, _ = drawn.shape
    assert width == pictures.WIDTH // 4 and height > 500 and drawn.var() > 100
    # the committed picture too: the seed's report, as wide, about as long (fonts differ by machine), its top drawn
    png = (ROOT / "docs" / "images" / "report.png").read_bytes()
    assert struct.unpack(">II", png[16:24]) == (pictures.WIDTH, pytest.approx(height * 4, abs=800))
    assert png_pixels(png, limit=120).var() > 100


def test_the_terminal_picture_is_current(chromium, written, monkeypatch):
    """terminal.svg is what scripts/pictures.py writes from the seed's replay (here the post-mortem's, which is
    that replay), byte for byte, where the replaying CPU and rich are those its first line names; it fetches
    nothing when opened."""
    from importlib.metadata import version

    from nanforensics.runs.cpu import describe, this_cpu

    committed = (ROOT / "docs" / "images" / "terminal.svg").read_text(encoding="utf-8")
    here = pictures.SVG_HEADER.format(run=pictures.SEED, cpu=describe(this_cpu()), rich=version("rich"))
    if not committed.startswith(here):
        pytest.skip(f"the picture was drawn elsewhere ({committed.splitlines()[0]}); here: {here.strip()}; "
                    "python -m scripts.pictures draws it here")
    monkeypatch.chdir(ROOT)
    replay = load_report(written["report-replay"][0].with_suffix(".json"))
    assert pictures.terminal_svg(replay) == committed
    page = chromium.open(ROOT / "docs" / "images" / "terminal.svg")
    visit = page.settle()
    page.close()
    assert (visit.requests, visit.console, visit.errors) == ([], [], [])


def test_the_pictures_script_without_a_browser_ends_in_one_line():
    p = subprocess.run([sys.executable, "-m", "scripts.pictures"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PATH": "/nonexistent"}, timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "no headless browser found" in p.stderr
