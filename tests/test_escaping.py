"""Text from a run leaves escaped, by class: names and ids with every control character, escape sequence, bidi
override, rich markup, HTML and Markdown special, generated, through the one escaping function of each destination
(terminal, HTML, Markdown, JUnit XML) and through a real recorded run whose module, sample ids and folder are spelled with
them, replayed, reported and re-rendered by the CLI."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import shutil
import unicodedata
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt
from mdit_py_plugins.dollarmath import dollarmath_plugin
from nanforensics.checkpoints.scan import ScanReport, scan_checkpoint
from nanforensics.cli import say
from nanforensics.errors import BadInput
from nanforensics.formats import open_checkpoint
from nanforensics.saved import load_report
from nanforensics.views.checkpoints import render_scan_terminal
from nanforensics.views.escaping import (
    MAX_SHOWN,
    code,
    cut,
    fenced,
    markup,
    md_text,
    unencodable_escaped,
    visible,
    xml_document,
    xml_text,
)
from nanforensics.views.html import render_html
from nanforensics.views.markdown import render, render_scan
from nanforensics.views.postmortem import render_junit
from nanforensics.views.report import render_terminal
from rich.console import Console
from rich.text import Text

import hostile_names
from conftest import assert_one_line_error, error_lines, run_cli
from hostile_names import appended

C0 = [chr(c) for c in range(0x20)]
C1 = [chr(c) for c in range(0x80, 0xA0)]
BIDI = ["\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069", "\u200e", "\u200f",
        "\u061c"]
SEQUENCES = ["\x1b]0;title\x07", "\x1b[2J", "\x1b[31m", "\x1b]8;;https://evil\x1b\\link\x1b]8;;\x1b\\", "\x9b2J",
             "\r\nCLEAN", "[red]x[/red]", "[link=https://evil]y[/link]", "[/]", "[bold", ":skull:", "\\[b]",
             "<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "&amp;", "&lt;", "\"'", "]]>", "-->",
             "|", "`", "``", "**", "_x_", "~~", "$x$", "[a](https://evil)", "![i](https://evil/p.png)", "<https://evil>",
             "\\", "\\|", "# ", "\n- ", "\n1. ", "\n---\n", "\n```\n", "&#124;", "<details>", "</details>"]
# Pieces a name or id is made of: the control characters one by one, whole escape sequences, markup and HTML, and
# any code point at all (surrogates too: the undecodable bytes of a file name).
hostile = st.lists(st.one_of(st.sampled_from(C0 + ["\x7f"] + C1 + BIDI + ["\u2028", "\u2029", "\ufeff"]),
                             st.sampled_from(SEQUENCES), st.text(st.characters(exclude_categories=()), max_size=4)),
                   max_size=8).map("".join)

EXAMPLES = settings(max_examples=300, deadline=None)


def printable(text: str, keep: str = "") -> bool:
    """Nothing a terminal acts on or a reader cannot see: letters, marks, numbers, punctuation, symbols, spaces."""
    return all(c in keep or unicodedata.category(c)[0] in "LMNPS" or unicodedata.category(c) == "Zs" for c in text)


# ---- the escaping functions, on generated text ---------------------------------------------------------------


@EXAMPLES
@given(hostile)
def test_visible_leaves_one_line_of_printable_characters(text):
    shown = visible(text)
    assert printable(shown) and "\n" not in shown
    assert len(shown.splitlines()) <= 1  # no line or paragraph separator either
    for c in set(text) - set(shown):  # what went is written out: ESC as \x1b, U+202E as \u202e
        assert visible(c).startswith("\\") and len(visible(c)) > 1 and visible(c) in shown


@EXAMPLES
@given(st.text(st.characters(categories=("L", "M", "N", "P", "S", "Zs"))))
def test_visible_leaves_printable_text_as_it_is(text):
    assert visible(text) == text


# one code point in 97 of all of Unicode, and the edges of XML 1.0's Char production
CODE_POINTS = sorted({*range(0, 0x110000, 97), 0x9, 0xA, 0xD, 0x1F, 0x20, 0x7E, 0x7F, 0xD7FB, 0xD7FF, 0xD800, 0xDFFF,
                      0xE000, 0xFFFC, 0xFFFD, 0xFFFE, 0xFFFF, 0x10000, 0x1F600, 0x10FFFF})


def test_xml_text_keeps_every_printable_character_and_escapes_the_rest():
    """Every code point sampled across Unicode, in a text node: the document parses (XML 1.0 refuses C0 controls,
    surrogates, U+FFFE/FFFF), a letter, mark, number, punctuation, symbol, space, newline or tab reads back as itself,
    and anything else reads back as a visible escape, never as itself."""
    for cp in CODE_POINTS:
        ch = chr(cp)
        body = ET.fromstring(f"<a>x{xml_text(ch)}y</a>").text
        keep = ch in "\t\n" or unicodedata.category(ch)[0] in "LMNPS" or unicodedata.category(ch) == "Zs"
        assert (body == f"x{ch}y") == keep, (hex(cp), unicodedata.category(ch), body)
    kept = "".join(chr(cp) for cp in CODE_POINTS if chr(cp) in "\t\n" or unicodedata.category(chr(cp))[0] in "LMNPS")
    assert xml_text(kept) == kept  # characters in a row: nothing between them



# What an escape looks like at each of its widths' edges: the last code points of two and four hex digits and the
# first past them that are escaped at all (U+0100 and U+10000 are letters, kept).
ESCAPES = {"\x00": "\\x00", "\x9f": "\\x9f", "\xad": "\\xad", "\u0378": "\\u0378", "\u200e": "\\u200e",
           "\ufeff": "\\ufeff", "\uffff": "\\uffff", "\U0001000c": "\\U0001000c", "\U000e0001": "\\U000e0001",
           "\U0010ffff": "\\U0010ffff", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def test_an_escape_has_the_width_of_its_code_point():
    for ch, escape in ESCAPES.items():
        assert visible(f"a{ch}b") == f"a{escape}b"
        assert xml_text(ch) == (ch if ch in "\t\n" else escape)


@pytest.mark.parametrize("n", [0, 1, MAX_SHOWN - 1, MAX_SHOWN, MAX_SHOWN + 1, 5000])
def test_a_text_is_shown_whole_up_to_its_limit_and_cut_past_it_with_its_count(n):
    text = "x" * n
    assert cut(text) == (text if n <= MAX_SHOWN else f"{'x' * MAX_SHOWN}... ({n - MAX_SHOWN} more characters)")


def test_markup_of_every_short_text_of_brackets_and_backslashes_stays_text():
    """Every text of one to four characters over two brackets, a backslash, a slash and two letters (1,554), enumerated: a
    tag's opening, a backslash before one or before the end, in rich's own markup around it, reads as itself."""
    for n in range(1, 5):
        for chars in itertools.product("[]\\/ab", repeat=n):
            text = "".join(chars)
            rendered = Text.from_markup(f"[dim]{markup(text)}[/dim]", emoji=False)
            assert rendered.plain == text and [span.style for span in rendered.spans] == ["dim"], repr(text)


def test_the_xml_writer_escapes_the_text_after_an_element_too():
    root = ET.Element("testsuite")
    ET.SubElement(root, "testcase").tail = "after\x1b[2J\u202e"
    ET.SubElement(root, "testcase")
    parsed = ET.fromstring(xml_document(root).encode())
    assert [(case.tail or "").strip() for case in parsed] == ["after\\x1b[2J\\u202e", ""]


def test_a_stream_that_cannot_encode_a_character_writes_its_escape():
    """``LANG=C``: each stream given (a terminal's, a log's) writes what its encoding lacks as an escape; a stream
    without ``reconfigure`` is left as it is."""
    raw = [io.BytesIO(), io.BytesIO()]
    streams = [io.TextIOWrapper(b, encoding="ascii") for b in raw]
    unencodable_escaped(streams[0], io.StringIO(), streams[1])
    for stream, written in zip(streams, raw):
        stream.write("r\u00e9sum\u00e9 \u202e\U0001f600")
        stream.flush()
        assert written.getvalue() == b"r\\xe9sum\\xe9 \\u202e\\U0001f600"


@EXAMPLES
@given(hostile)
def test_markup_stays_text_in_rich(text):
    """A sample id ``[red]x[/red]`` or ``[link=...]`` is shown as written, never styled or linked."""
    rendered = Text.from_markup(f"[dim]{markup(text)}[/dim]", emoji=False)  # inside the views' own markup
    assert rendered.plain == visible(text) and [span.style for span in rendered.spans] == ["dim"]


@EXAMPLES
@given(hostile, hostile)
def test_the_xml_writer_writes_any_text_as_parseable_xml(attribute, text):
    root = ET.Element("testsuite", name=attribute)
    ET.SubElement(root, "failure", message=attribute).text = text
    parsed = ET.fromstring(xml_document(root).encode())
    assert parsed.get("name") == parsed.find("failure").get("message") == visible(attribute)
    body = parsed.find("failure").text or ""
    assert body == xml_text(text) and printable(body, keep="\n\t")  # its lines kept, each printable


@settings(max_examples=100, deadline=None)
@given(hostile, hostile)
def test_an_error_is_one_printable_line(where, problem):
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        say(f"nanforensics: error: {BadInput(where, problem)}")
    err = stderr.getvalue()
    assert err.endswith("\n") and err.count("\n") == 1 and printable(err, keep="\n"), err


# ---- a real run whose names are an attacker's ----------------------------------------------------------------

RUN_NAME = "run\x1b]0;t\x07\n[bold]r<u>\u202e:skull:"
TEMPLATE_TAGS = {"html", "head", "meta", "title", "style", "body", "main", "h1", "h2", "span", "table", "tr", "th",
                 "td", "code", "ul", "ol", "li", "svg", "text", "path", "rect", "line", "polyline", "circle", "div",
                 "i", "b", "footer"}


class Tags(HTMLParser):
    """Every element and attribute name in a page, and its text."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.attributes: set[str] = set()
        self.text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.attributes |= {name for name, _ in attrs}

    def handle_data(self, data):
        self.text.append(data)


def assert_page_is_the_templates(html: str) -> Tags:
    page = Tags(html)
    assert page.tags <= TEMPLATE_TAGS, page.tags - TEMPLATE_TAGS
    assert not {a for a in page.attributes if a.startswith("on")} and "<script" not in html
    assert printable(html, keep="\n"), {c for c in html if not printable(c, keep="\n")}
    return page


def assert_terminal_safe(*outputs: str) -> None:
    for out in outputs:
        assert printable(out, keep="\n"), sorted({repr(c) for c in out if not printable(c, keep="\n")})


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory) -> dict[str, Any]:
    """The run recorded, then examined once by ``postmortem`` with every output: the terminal, JSON, HTML, JUnit."""
    root = tmp_path_factory.mktemp("hostile")
    run = hostile_names.record(root / RUN_NAME)
    out = {name: root / f"report.{name}" for name in ("json", "html", "xml")}
    result = run_cli("postmortem", run, "--json", out["json"], "--html", out["html"], "--junit", out["xml"],
                     columns=300)
    assert result.code == 1, result.stderr
    return {"run": run, "root": root, "result": result, **{k: p.read_text(encoding="utf-8") for k, p in out.items()},
            "json_path": out["json"]}


def test_the_postmortem_shows_the_names_escaped(hostile_run):
    result = hostile_run["result"]
    assert_terminal_safe(result.stdout, result.stderr)
    shown = visible(hostile_names.HOSTILE)
    # The module name opens every tensor name: the origin, the chain and the heatmap's rows show it escaped, and
    # its markup as text (a word rich never breaks across lines).
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in result.stdout and "[red]x[/red][link=https://evil]y[/link]" in result.stdout
    assert f"grad {shown.split(' ')[0]}" in result.stdout
    assert visible(RUN_NAME) in result.stdout  # the run's folder, in the facts


def test_the_html_report_holds_run_text_only_as_text(hostile_run):
    page = assert_page_is_the_templates(hostile_run["html"])
    text = "".join(page.text)
    assert "<script>alert(1)</script><img src=x onerror=alert(1)>&amp;" in text  # shown, as text
    assert visible(RUN_NAME) in text


def test_the_junit_report_parses_and_names_the_origin(hostile_run):
    suite = ET.fromstring(hostile_run["xml"].encode()).find("testsuite")
    failure = suite.find("testcase/failure")
    assert "\\x1b]0;pwned" in failure.get("message") and printable(failure.get("message"))
    assert printable(failure.text, keep="\n") and suite.find("properties/property").get("value").endswith(
        visible(RUN_NAME))


def test_report_re_renders_the_saved_report_escaped(hostile_run, tmp_path):
    html, markdown = tmp_path / "again.html", tmp_path / "again.md"
    result = run_cli("report", hostile_run["json_path"], "--html", html, "--markdown", markdown, columns=300)
    assert result.code == 0, result.stderr
    assert_terminal_safe(result.stdout, result.stderr, markdown.read_text(encoding="utf-8"))
    assert "[red]x[/red][link=https://evil]y[/link]" in result.stdout
    assert html.read_text(encoding="utf-8") == hostile_run["html"]


def test_errors_naming_hostile_files_and_import_strings_are_one_line(hostile_run, tmp_path):
    # A file name with newlines and escapes: one line, which never says CLEAN at its start.
    missing = tmp_path / "x\x1b]0;t\x07\nCLEAN\x1b[2J.pt"
    result = run_cli("scan", missing)
    assert_one_line_error(result, "\\x1b]0;t\\x07\\nCLEAN\\x1b[2J.pt")
    assert_terminal_safe(result.stdout, result.stderr)
    # A manifest string (the model factory's import string) spelled the same way: announced and refused, escaped.
    copy = tmp_path / "copy"
    shutil.copytree(hostile_run["run"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["model_factory"] = "no_such\x1b]0;t\x07\nCLEAN[red]:build"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    result = run_cli("replay", copy)
    assert result.code == 2 and len(error_lines(result.stderr)) == 1, result.stderr
    assert_terminal_safe(result.stdout, result.stderr)
    assert "no_such\\x1b]0;t\\x07\\nCLEAN[red]:build" in result.stderr


# ---- every string of a report, generated ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def scanned(hostile_run) -> ScanReport:
    """The run's poisoned checkpoint, scanned whole: tensor names and groups in every table of the scan's view."""
    return scan_checkpoint(open_checkpoint(hostile_run["run"] / "checkpoints" / "step_00000010"), full=True)


@pytest.fixture(scope="module")
def saved(hostile_run) -> Any:
    """The post-mortem's saved report, read once: the examples below spell copies of it (``hostile_names.appended``)."""
    return load_report(hostile_run["json_path"])


def _console() -> Console:
    return Console(file=io.StringIO(), width=200, color_system=None, highlight=False, emoji=False)


@settings(max_examples=20, deadline=None)
@given(text=hostile)
def test_every_string_of_a_report_leaves_escaped(saved, scanned, text):
    """The post-mortem's report (its replay and bisection inside) and a scan's, with ``text`` in every string
    field, rendered by every view."""
    report = appended(saved, text)
    console = _console()
    render_terminal(report, console)
    render_scan_terminal(appended(scanned, text), console)
    assert_terminal_safe(console.file.getvalue())
    assert_page_is_the_templates(render_html(report))
    suite = ET.fromstring(render_junit(report).encode())
    for element in suite.iter():
        assert all(printable(v) for v in element.attrib.values())
        assert printable(element.text or "", keep="\n\t")


# ---- Markdown: a run's text never changes the structure of the page ------------------------------------------

# GitHub's flavour as far as a page's structure goes: GFM tables and strikethrough, and the math a step summary
# renders ($...$, $$...$$): a parser without it cannot see an unescaped dollar turn text into a formula
_MARKDOWN = MarkdownIt("commonmark").enable(["table", "strikethrough"]).use(dollarmath_plugin, double_inline=True)


def _structure(markdown: str) -> list[str]:
    """The page's blocks and inline elements, as a CommonMark + GFM + math parser sees them, without their text."""
    out = []
    for token in _MARKDOWN.parse(markdown):
        out.append(token.type if token.type != "html_block" else f"html_block {token.content.strip()}")
        out += [child.type for child in token.children or [] if child.type not in ("text", "text_special")]
    return out


def _heading(markdown: str) -> str:
    tokens = _MARKDOWN.parse(markdown)
    return next(tokens[i + 1].children and "".join(c.content for c in tokens[i + 1].children)
                for i, t in enumerate(tokens) if t.type == "heading_open")


@pytest.fixture(scope="module")
def plain_structures(saved, scanned) -> tuple[list[str], list[str]]:
    """The structure of the post-mortem's and the scan's Markdown as the run wrote them, parsed once."""
    return _structure(render(saved)), _structure(render_scan(scanned))


@settings(max_examples=40, deadline=None)
@given(text=hostile)
def test_markdown_keeps_its_structure_whatever_the_run_says(saved, scanned, plain_structures, text):
    """Every string field of a post-mortem (its replay and bisection inside) and of a scan with ``text`` appended: the
    same headings, lists, tables (rows and cells), code spans and emphasis as without it, no HTML but the page's own,
    no link or image; and the heading shows the text as it is, made visible."""
    page = render(appended(saved, text))
    for plain, spelled in zip(plain_structures, (page, render_scan(appended(scanned, text)))):
        assert _structure(spelled) == plain
        assert printable(spelled, keep="\n")
    assert _heading(page) == \
        f"nanforensics post-mortem: non-finite - {visible(saved.headline + text)}".rstrip()  # as CommonMark ends one


@pytest.mark.parametrize("piece", SEQUENCES)
def test_markdown_keeps_its_structure_with_each_hostile_piece(saved, scanned, plain_structures, piece):
    """The pieces hostile text is made of, each one in every string field, listed rather than left to sampling: a
    math formula, a link, a table pipe or an emphasis is the run's text, never the page's structure."""
    for plain, spelled in zip(plain_structures, (render(appended(saved, piece)), render_scan(appended(scanned, piece)))):
        assert _structure(spelled) == plain, piece


def _inline_text(markdown: str) -> str:
    """What a reader sees of one line of Markdown: its text, if it parsed as nothing but text."""
    children = _MARKDOWN.parseInline(markdown)[0].children or []
    assert all(c.type in ("text", "text_special") for c in children), (markdown, [c.type for c in children])
    return "".join(c.content for c in children)


def test_markdown_text_reads_as_itself():
    """md_text renders as the text it was given, made visible, and nothing else (the structure tests above see
    elements, not words: md_text of anything rendered as "None" kept every page's structure): each printable ASCII
    character alone, doubled, inside a word and at a word's edges, and each hostile piece, enumerated."""
    texts = [t for c in map(chr, range(0x20, 0x7F)) for t in (c, c + c, f"a{c}b", f"{c}a{c}")] + SEQUENCES
    for text in texts:
        assert _inline_text(f"x {md_text(text)} y") == f"x {visible(text)} y".strip() or text.isspace(), repr(text)


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.sampled_from("`| \\ab\n"), min_size=1, max_size=12) | hostile.filter(bool))
def test_markdown_code_holds_any_text(text):
    """A code span, in a table cell or not, and a fenced block hold any text whole: backticks and pipes included."""
    _assert_code_holds(text)


def test_markdown_code_holds_every_short_text():
    """Every text of one to four characters over a backtick, a space, a pipe, a backslash and a letter (780),
    enumerated: the edges CommonMark treats apart (a space or a backtick at either end, all spaces) are all there.
    (A span padded always, or never for a text with a space at each end, passed the sampled test above.)"""
    for n in range(1, 5):
        for chars in itertools.product("` |\\a", repeat=n):
            _assert_code_holds("".join(chars))


def _assert_code_holds(text: str) -> None:
    shown = visible(text)
    inline = _MARKDOWN.parseInline(f"x {code(text)} y")[0].children
    assert [c.type for c in inline] == ["text", "code_inline", "text"] and inline[1].content == shown, repr(text)
    cells = [t for t in _MARKDOWN.parse(f"| h | k |\n|---|---|\n| {code(text, cell=True)} | z |") if t.type == "inline"]
    assert [c.content for c in cells[2].children] == [shown] and cells[3].content == "z", repr(text)
    lines = f"a\n{text}\nb"
    blocks = [t for t in _MARKDOWN.parse(fenced(lines)) if t.type == "fence"]
    assert len(blocks) == 1 and blocks[0].content == "\n".join(map(visible, lines.split("\n"))) + "\n", repr(text)
    assert blocks[0].info == ""  # no language unless one is given


@pytest.mark.parametrize("words, kept", [
    (["w" * 400], True),  # a long tensor name or path: whole
    (["a" * 10] * 300, True),  # a long sentence: its words wrap, whole
    (["w" * 5000], False),  # one hostile word (a manifest string): cut, counted
    (["id", "x" * 100_000, "then"], False),
])
def test_a_word_is_cut_where_it_would_widen_every_line(words, kept):
    """A terminal view widens to its longest word rather than break a name (views/layout.py): a word of thousands of
    characters from a run is cut on its way out, with its count, so that no line of a report grows with it."""
    text = " ".join(words)
    shown = visible(text)
    assert (shown == text) == kept
    assert max(map(len, shown.split())) <= 600
    if not kept:
        longest = max(map(len, words))
        assert f"({longest - 512} more characters)" in shown
