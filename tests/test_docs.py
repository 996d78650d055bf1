"""Every example in README.md and docs/*.md runs, and shows what it prints.

The convention (docs/development.md, "Examples that run"): a ```bash block is a script run with ``bash -euo pipefail``;
a ```console block holds commands (``$ `` lines) each followed by its expected output, where a line ``...`` matches any
number of lines and a trailing ``...`` the rest of a line; a ```python block is one script. Each runs in a fresh
temporary folder of symlinks to the repository's top-level entries, so it reads ``sample_runs/`` by relative path and
whatever it writes stays there, with this environment's ``nanforensics`` and ``python`` first on PATH. It must exit 0
unless the line before its fence says ``<!-- exit: N -->``; ``<!-- not-run: REASON -->`` there says why it is not run.
Any other language is shown, not run, and must be one of ``SHOWN``: a shell block spelt ``sh`` would escape the runner.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, tree_digest

RUN = ("bash", "console", "python")
SHOWN = ("text", "json", "yaml", "toml", "ini", "xml", "html", "markdown", "diff")  # an allow-list: anything else fails
MARKER = re.compile(r"^<!--\s*(exit|not-run):(.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>`{3,})(?P<lang>[^`\s]*)\s*$")
TIMEOUT = 300  # seconds a block may take: a hang fails instead of stalling the suite
COLUMNS = "80"  # the terminal width the shown outputs were taken at


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it starts, its language, its text and what the line before it says."""

    page: str  # relative to the repository
    line: int  # the fence's line, 1-based
    lang: str
    text: str
    marker: tuple[str, str] | None  # ("exit", "1") or ("not-run", "why"), from the line before the fence

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def exit_code(self) -> int:
        return int(self.marker[1]) if self.marker and self.marker[0] == "exit" else 0


def pages() -> list[Path]:
    """README.md and every page of the site: pages other changes add are collected without a list to update."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(page: str, text: str) -> list[Block]:
    """The fenced blocks of one Markdown text, indented ones (inside a list item) with their indentation taken off."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, ticks = len(opening["indent"]), opening["ticks"]
        end = i + 1
        while end < len(lines) and not re.fullmatch(rf" *{ticks}`*\s*", lines[end]):
            end += 1
        marker = MARKER.match(lines[i - 1].strip()) if i else None
        body = "\n".join(line[indent:] if not line[:indent].strip() else line.lstrip() for line in lines[i + 1:end])
        blocks.append(Block(page, i + 1, opening["lang"], body + "\n",
                            (marker[1], marker[2].strip()) if marker else None))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in parse(str(p.relative_to(ROOT)), p.read_text())]


BLOCKS = all_blocks()
RUNNABLE = [b for b in BLOCKS if b.lang in RUN and not (b.marker and b.marker[0] == "not-run")]


# ---- what a shown output matches ----------------------------------------------------------------------------------

def matches(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` lines fit ``expected``: ``...`` alone matches any run of lines (none too), a line ending in
    ``...`` any line that starts with the rest; every other line must be equal. Trailing spaces never count."""
    expected, actual = [e.rstrip() for e in expected], [a.rstrip() for a in actual]
    # reach[j]: expected[:i] can match actual[:j]; one row per expected line
    reach = [True] + [False] * len(actual)
    for e in expected:
        if e == "...":
            nxt, seen = [], False
            for r in reach:
                seen = seen or r
                nxt.append(seen)
        else:
            def fits(a: str, e: str = e) -> bool:
                return a.startswith(e[:-3]) if e.endswith("...") else a == e
            nxt = [False] + [reach[j] and fits(actual[j]) for j in range(len(actual))]
        reach = nxt
    return reach[-1]


def console_commands(block: Block) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for each ``$ `` line; a command ending in a backslash goes on."""
    out: list[tuple[str, list[str]]] = []
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        assert out or line.startswith("$ "), f"{block.id}: a console block starts with a `$ ` command: {line!r}"
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command += "\n" + lines[i]  # bash reads the backslash-newline as one line
            out.append((command, []))
        else:
            out[-1][1].append(line)
        i += 1
    for _, expected in out:
        while expected and not expected[-1].strip():
            expected.pop()
    return out


# ---- running a block ----------------------------------------------------------------------------------------------

COPIED = ("sample_runs",)  # copied, not linked: the trust policy judges a run's code by where its file really lies


def tracked() -> list[str]:
    """The repository's top-level entries that git tracks: an allow-list, so that a stray folder in the checkout (a
    ``runs/`` left by a manual try) is never linked, and an example writing ``runs/exp1`` writes into its own folder,
    not through a link into the checkout."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return sorted({path.split("/", 1)[0] for path in listed.split("\0") if path and not path.startswith(".")})


def workspace(tmp: Path) -> Path:
    """A fresh folder whose entries are symlinks to the repository's tracked top-level ones (not its hidden ones), but
    for ``COPIED``: the samples name their code ``sample_runs/code/regressor.py``, which through a symlink would lie
    outside the working directory, and a run's code may come only from there (docs/security.md)."""
    for name in tracked():
        if name in COPIED:
            shutil.copytree(ROOT / name, tmp / name)
        else:
            (tmp / name).symlink_to(ROOT / name)
    return tmp


def environment(tmp: Path) -> dict[str, str]:
    """The test's ``nanforensics`` and ``python`` first on PATH, a fixed width, and nothing a CI runner sets that a
    command would write to (``$GITHUB_STEP_SUMMARY``) or import from (``$PYTHONPATH``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GITHUB_") and k not in ("PYTHONPATH", "CI")}
    env.update(PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]), COLUMNS=COLUMNS,
               NO_COLOR="1", TERM="dumb", HOME=str(tmp / ".home"))
    return env


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=environment(cwd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=TIMEOUT)


def script_name(block: Block) -> str:
    """A Python block saves as the file its first line names (``# train_accum.py: ...``), else ``example.py``."""
    named = re.match(r"#\s*([\w.-]+\.py)\b", block.text)
    return named[1] if named else "example.py"


def execute(block: Block, cwd: Path) -> None:
    if block.lang == "console":
        commands = console_commands(block)
        for k, (command, expected) in enumerate(commands):
            done = run(["bash", "-o", "pipefail", "-c", command], cwd)
            want = block.exit_code if k == len(commands) - 1 else 0
            assert done.returncode == want, f"{block.id}: `{command}` exited {done.returncode}, not {want}:\n{done.stdout}"
            actual = done.stdout.rstrip().splitlines()
            assert matches(expected, actual), (f"{block.id}: `{command}` printed\n" + "\n".join(actual)
                                               + "\n---- where the page shows ----\n" + "\n".join(expected))
        return
    if block.lang == "bash":
        (cwd / "example.sh").write_text(block.text)
        done = run(["bash", "-euo", "pipefail", "example.sh"], cwd)
    else:
        (cwd / script_name(block)).write_text(block.text)
        done = run([sys.executable, script_name(block)], cwd)
    assert done.returncode == block.exit_code, f"{block.id} exited {done.returncode}, not {block.exit_code}:\n{done.stdout}"


@pytest.fixture(scope="module")
def samples_before() -> dict[str, str]:
    return tree_digest(ROOT / "sample_runs")


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_example_runs(block: Block, tmp_path: Path, samples_before: dict[str, str]) -> None:
    execute(block, workspace(tmp_path))
    assert tree_digest(tmp_path / "sample_runs") == samples_before, f"{block.id} wrote into sample_runs/"


# ---- the convention itself ----------------------------------------------------------------------------------------

def test_every_block_is_run_or_shown_on_purpose() -> None:
    """A fence's language is one that runs or one of the shown ones; a marker says a number or a reason, and stands
    only before a block that would run."""
    wrong = [f"{b.id}: ```{b.lang or '(no language)'}" for b in BLOCKS if b.lang not in RUN + SHOWN]
    assert not wrong, "write bash, console or python (run), or one of " + ", ".join(SHOWN) + " (shown):\n" + "\n".join(wrong)
    for b in BLOCKS:
        if b.marker:
            assert b.lang in RUN, f"{b.id}: <!-- {b.marker[0]} --> before a block that is not run"
            if b.marker[0] == "exit":
                assert b.marker[1].isdigit(), f"{b.id}: <!-- exit: N --> wants a number, not {b.marker[1]!r}"
            else:
                assert len(b.marker[1].split()) >= 3, f"{b.id}: <!-- not-run: REASON --> wants its reason"


def test_the_pages_hold_examples_that_run() -> None:
    """The collector finds what the pages hold: commands with their output and scripts, in the README too."""
    kinds = {lang: sum(b.lang == lang for b in RUNNABLE) for lang in RUN}
    assert kinds["console"] and kinds["python"], kinds
    assert any(b.page == "README.md" and b.lang == "console" for b in RUNNABLE)


def test_a_not_run_reason_names_files_that_exist() -> None:
    """A reason that points at the test or script that runs such a block instead names one that is there."""
    named = {(b.id, path) for b in BLOCKS if b.marker and b.marker[0] == "not-run"
             for path in re.findall(r"\b(?:tests|scripts|bench|examples)/[\w/.-]*\w", b.marker[1])}
    assert named and not [(i, path) for i, path in named if not (ROOT / path).exists()]


def test_parse_reads_markers_indentation_and_longer_fences() -> None:
    text = ("intro\n<!-- exit: 1 -->\n```console\n$ nanforensics replay x\nout\n```\n"
            "- item\n\n  ```bash\n  echo hi\n  ```\n"
            "<!-- not-run: needs eight GPUs under torchrun -->\n````python\nprint('```')\n````\n```text\nshown\n```\n")
    blocks = parse("page.md", text)
    assert [(b.line, b.lang, b.marker) for b in blocks] == [
        (3, "console", ("exit", "1")), (9, "bash", None), (13, "python", ("not-run", "needs eight GPUs under torchrun")),
        (16, "text", None)]
    assert blocks[1].text == "echo hi\n" and blocks[2].text == "print('```')\n"
    assert blocks[0].exit_code == 1 and blocks[1].exit_code == 0


def test_console_commands_split_with_continuations() -> None:
    block = parse("p.md", "```console\n$ a \\\n  --b\none\n\n$ c\ntwo\n\n```\n")[0]
    assert console_commands(block) == [("a \\\n  --b", ["one"]), ("c", ["two"])]


@pytest.mark.parametrize("expected, actual, fit", [
    (["a", "b"], ["a", "b"], True),
    (["a", "b  "], ["a", "b"], True),
    (["a"], ["a", "b"], False),  # every line is accounted for
    (["a", "b"], ["a"], False),
    (["...", "b"], ["x", "y", "b"], True),
    (["...", "b"], ["b"], True),  # ... matches no line too
    (["a", "...", "c"], ["a", "c"], True),
    (["a", "...", "c"], ["a", "b", "c", "d"], False),
    (["a", "..."], ["a", "b", "c"], True),
    (["╭─ NON-FINITE ..."], ["╭─ NON-FINITE   responsible step 27"], True),
    (["╭─ NON-FINITE ..."], ["╭─ CLEAN"], False),
    (["ab..."], ["a"], False),
    (["x..."], ["x"], True),
    (["...", "...", "z"], ["z"], True),
    ([], [], True),
    ([], ["a"], False),
])
def test_matches(expected: list[str], actual: list[str], fit: bool) -> None:
    assert matches(expected, actual) is fit


def test_a_wrong_output_or_exit_code_fails(tmp_path: Path) -> None:
    """The runner itself: a console block whose output or exit code differs from the page's fails, naming the block."""
    good = parse("p.md", "<!-- exit: 3 -->\n```console\n$ echo one; echo two; exit 3\none\n...\n```\n")[0]
    execute(good, tmp_path)
    for text in ("<!-- exit: 3 -->\n```console\n$ echo one; exit 3\ntwo\n```\n",
                 "```console\n$ echo one; exit 3\none\n```\n",
                 "```console\n$ false\n$ true\n```\n",
                 "```bash\ntrue\nfalse\ntrue\n```\n",
                 "```python\nraise SystemExit(4)\n```\n"):
        with pytest.raises(AssertionError, match=r"p\.md:\d"):
            execute(parse("p.md", text)[0], tmp_path)


def test_readme_links_point_at_files_that_exist() -> None:
    """README.md is read on GitHub and PyPI, outside the site: its relative links must still lead somewhere."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) + re.findall(r'src="([^"]+)"', text)
    local = [t for t in targets if not re.match(r"[a-z]+:", t)]
    assert local, "the README links into the docs"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, missing

