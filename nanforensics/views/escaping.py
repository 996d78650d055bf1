"""Text from a run on its way out, escaped once, by the one function of its destination.

Every string a run supplies (sample ids, file names, tensor and module names, manifest strings, group names, any
field of a saved report) is untrusted. For the terminal, ``visible`` keeps only printable characters and writes
every other one as a visible escape, so an escape sequence (``ESC]0;title BEL``, ``ESC[2J``), a bidi override or a
newline can neither act on the terminal nor split one line of output (an error) into several; ``markup`` adds
rich's escaping where rich parses the string as markup. HTML goes through Jinja2's autoescaping with ``visible`` as
its finalizer (views/html.py), Markdown through ``md_text`` as its templates' finalizer (views/markdown.py), JUnit XML
through ``xml_document``, which writes what XML 1.0 forbids visibly too.
"""

from __future__ import annotations

import re
import unicodedata
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:  # the command line imports this module at start-up, before any report needs XML
    import xml.etree.ElementTree as ET

# Allowed as they are: letters, marks, numbers, punctuation, symbols and spaces (Zs). Everything else - controls
# (C0, DEL, C1), format characters (bidi overrides, zero-width joiners), line and paragraph separators, surrogates
# (undecodable bytes of a file name), private-use and unassigned code points - is written as an escape.
_ALLOWED = frozenset("LMNPS") | {"Zs"}
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _allowed(ch: str) -> bool:
    category = unicodedata.category(ch)
    return category in _ALLOWED or category[0] in _ALLOWED


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


MAX_SHOWN = 4096  # characters of one text on its way out; the rest is cut, with its count (a manifest string of 64 MiB)
# characters of one word on its way out: a terminal view widens to its longest word rather than break a tensor name or a
# path (views/layout.py), so one hostile word would widen every line of a report. A word is a run without a space:
# other white space (a newline, NEL, U+3000) is escaped into visible text and joins the words around it.
MAX_WORD = 512
_LONG_WORD = re.compile(rf"[^ ]{{{MAX_WORD + 1},}}")


def cut(text: str) -> str:
    """``text``, or its first ``MAX_SHOWN`` characters and how many more there were."""
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}... ({len(text) - MAX_SHOWN} more characters)"


def _words_cut(text: str) -> str:
    """Each word longer than ``MAX_WORD`` cut to it, with how many more characters it had (a terminal's text: sentences
    wrap, so only a word sets a line's width; a page or a JUnit file wraps on its own)."""
    return _LONG_WORD.sub(lambda m: f"{m[0][:MAX_WORD]}... ({len(m[0]) - MAX_WORD} more characters)", text)


def visible(text: object) -> str:
    """``text`` as one line of printable characters: ``ESC`` becomes ``\\x1b``, a newline ``\\n``, U+202E
    ``\\u202e``; printable text (any script, symbols, emoji) is left as it is; at most ``MAX_SHOWN`` characters of
    it, and of each word ``MAX_WORD`` (``cut``)."""
    text = cut(_words_cut(str(text)))
    if text.isascii() and text.isprintable():  # the usual case: nothing to do
        return text
    return "".join(ch if _allowed(ch) else _escape(ch) for ch in text)


# rich.markup's tag (RE_TAGS without its leading backslashes): where one starts, rich reads k backslashes before
# it as k // 2 literal ones and an odd one as the tag's escape; elsewhere it reads a backslash before "[" as nothing.
_RICH_TAG = re.compile(r"\[[a-z#/@][^[]*?]")
_BEFORE_BRACKET = re.compile(r"(\\*)(\[|\Z)")


def _rich_bracket(m: re.Match[str]) -> str:
    k = len(m.group(1))
    if not m.group(2):  # the end: the tag a view writes next (``[/dim]``) must not be escaped by these
        return "\\" * (2 * k)
    return "\\" * (2 * k + 1 if _RICH_TAG.match(m.string, m.end(1)) else k + 1) + "["


def markup(text: object) -> str:
    """``visible(text)`` for a string rich parses as markup, rendered as itself: a sample id ``[red]x[/red]`` or
    ``[link=...]`` stays text, and so do backslashes before a bracket (``rich.markup.escape`` drops them)."""
    return _BEFORE_BRACKET.sub(_rich_bracket, visible(text))


# ---- Markdown ----------------------------------------------------------------------------------

# CommonMark lets a backslash escape any ASCII punctuation; these act inline (emphasis, code, links, images, HTML,
# entities, GFM tables and strikethrough, GitHub's math) or close an ATX heading. The rest (- . , : ( ) / = ...) act
# only at the start of a line, where no template puts a value.
_ACTIVE = re.compile(r"([\\`*_\[\]<>&|~$!#])")


class Markdown(str):
    """Markdown a filter wrote (a code span, a fenced block, a sub-report): the finalizer leaves it as it is."""


def md_text(value: object) -> str:
    """``value`` as Markdown text that renders as itself: one visible line, every active character escaped."""
    return _ACTIVE.sub(r"\\\1", visible(value))


def _fence(text: str, tick: str = "`") -> str:
    """A run of backticks longer than any in ``text``: a code span or block it cannot close."""
    longest = max((len(m) for m in re.findall(f"{re.escape(tick)}+", text)), default=0)
    return tick * (longest + 1)


def code(value: object, cell: bool = False) -> Markdown:
    """A code span holding ``value`` literally; in a table ``cell``, ``|`` is escaped (GFM splits cells first)."""
    text = visible(value)
    if cell:
        text = text.replace("|", "\\|")
    fence = _fence(text)
    # CommonMark strips one space from each end of a span that is not all spaces: padding keeps an edge backtick apart
    pad = " " if (text.startswith("`") or text.endswith("`")) or (text.startswith(" ") and text.endswith(" ")
                                                                  and text.strip()) else ""
    return Markdown(f"{fence}{pad}{text}{pad}{fence}")


def fenced(text: str, info: str = "") -> Markdown:
    """A fenced code block holding ``text`` literally, line by line."""
    body = "\n".join(map(visible, text.split("\n")))
    fence = _fence(body)
    fence = fence if len(fence) >= 3 else "```"
    return Markdown(f"{fence}{info}\n{body}\n{fence}")


# ---- XML ---------------------------------------------------------------------------------------


def _xml_allowed(ch: str) -> bool:
    """The characters XML 1.0 admits (its production ``Char``), less the ones ``visible`` escapes (but newline and
    tab, which a text node keeps)."""
    code = ord(ch)
    legal = ch in "\t\n" or 0x20 <= code <= 0xD7FF or 0xE000 <= code <= 0xFFFD or code >= 0x10000
    return legal and (ch in "\t\n" or _allowed(ch))


def xml_text(text: str) -> str:
    """A text node's content: lines kept, every other character XML forbids or a terminal would act on escaped; at
    most ``MAX_SHOWN`` characters of it."""
    return "".join(ch if _xml_allowed(ch) else _escape(ch) for ch in cut(text))


# ---- the terminal and the log ------------------------------------------------------------------


def unencodable_escaped(*streams: TextIO) -> None:
    """Every character a stream's encoding cannot hold (``LANG=C``, ``PYTHONIOENCODING=ascii``: a sample id in
    Cyrillic) written as an escape (``\\xe9``), as ``visible`` writes what it escapes: text on its way out never ends
    a command with ``UnicodeEncodeError``. Applied to stdout and stderr when the command line starts, so every writer
    (rich, a report to ``-``, click's usage errors) has it."""
    for stream in streams:
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")


def xml_document(root: ET.Element) -> str:
    """The one writer of XML: every attribute becomes one visible line, every text node legal XML 1.0; then
    ElementTree's own escaping of ``<``, ``&`` and quotes."""
    import xml.etree.ElementTree as ET

    for element in root.iter():
        element.attrib = {key: visible(value) for key, value in element.attrib.items()}
        if element.text is not None:
            element.text = xml_text(element.text)
        if element.tail is not None:
            element.tail = xml_text(element.tail)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
