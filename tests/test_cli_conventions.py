"""The conventions of the tools people already run beside it (pytest, ruff, git): --version and -h, plain help,
output that stays readable in a pipe or a CI log at any $COLUMNS, a documented synopsis that lists every option, and
JUnit XML that CI dashboards line up across runs."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import torch
import typer
from nanforensics import __version__
from nanforensics.cli import app
from nanforensics.report import to_json
from nanforensics.views.postmortem import render_junit

from conftest import run_cli
from postmortem_cases import examined
from test_docs import pages, parse

LONG = "model.encoder.layers.11.self_attention.query_key_value.weight"  # 61 characters


def test_version_and_short_help():
    version = run_cli("--version")
    assert (version.code, version.stdout) == (0, f"nanforensics {__version__}\n")
    result = run_cli("-h")  # a command's -h: test_help_is_plain_text_rewrapped_to_the_width
    assert result.code == 0 and result.stdout.startswith("Usage: nanforensics [OPTIONS] COMMAND"), result.stderr


def test_help_is_plain_text_rewrapped_to_the_width():
    result = run_cli("postmortem", "-h", columns=70)
    text = result.stdout
    assert not re.search(r"<\w+(\[\w+\])?>", text), text  # no <str>, <bool>, <path>, <list[str]> tags
    assert not set(text) & set("╭╮╰╯│─"), text  # no boxes
    assert "Usage: nanforensics postmortem [OPTIONS] DIR\n" in text
    assert "--json PATH" in text and "--html PATH" in text
    assert all(len(line) <= 70 for line in text.splitlines())
    # The docstring's own line break (after "2 bad input,") is not kept: the sentence is rewrapped as a whole.
    assert "2 bad input, 3 logged NaN" in " ".join(text.split())
    assert not any(line.rstrip().endswith("2 bad input,") for line in text.splitlines())


def documented_synopsis(command: str) -> str:
    """Every line of a shown block of the README or the manual that starts ``nanforensics COMMAND`` (the synopses), with
    its backslash continuations."""
    text = "\n".join(b.text for p in pages() for b in parse(str(p), p.read_text()) if b.lang == "text").replace("\\\n", " ")
    return "\n".join(re.findall(rf"^nanforensics {command} .*$", text, re.MULTILINE))


def test_the_documented_synopsis_lists_every_option():
    group = typer.main.get_command(app)
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        synopsis = documented_synopsis(name)
        assert synopsis, f"no synopsis of `nanforensics {name}` in the README or docs/"
        for param in command.params:
            names = param.opts + param.secondary_opts
            if isinstance(param, typer.core.TyperOption) and "--help" not in names:
                assert any(re.search(rf"{re.escape(n)}\b", synopsis) for n in names), (name, names, synopsis)


def test_a_scan_in_a_narrow_log_keeps_names_and_columns_whole(tmp_path):
    state = {LONG: torch.ones(4, 4), "head.bias": torch.full((4,), 60000.0).half()}
    state[LONG][1, 2] = float("nan")
    state["head.bias"][0] = float("inf")
    torch.save(state, tmp_path / "ck.pt")
    result = run_cli("scan", tmp_path / "ck.pt", "--full", columns=60)  # the table needs 113 columns
    assert result.code == 1, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.split()}
    assert "…" not in result.stdout
    assert rows["tensor"].split("  ")[-1].strip() == "max |x| / limit"
    assert rows[LONG].split()[-3:] == ["1", "/", "3.4e+38"] and "[1, 2] = nan" in rows[LONG]
    assert rows["head.bias"].split()[-3:] == ["6e+04", "/", "6.55e+04"]
    assert result.stdout.splitlines()[-1].startswith("Verdict: ")


def test_panels_take_the_columns_given(tmp_path, runs):
    """Panels are as wide as $COLUMNS; only a word longer than that (a long path) would widen one."""
    run = runs["adam_near_zero"]
    saved = tmp_path / "postmortem.json"
    saved.write_text(to_json(examined(run)).replace(str(run), "run"))
    lines = run_cli("report", saved, columns=110).stdout.splitlines()
    panels = [line for line in lines if line.startswith(("╭", "╰"))]
    assert len(panels) == 4 and all(len(line) == 110 for line in panels), panels


def test_junit_lines_up_across_runs(runs):
    r = examined(runs["adam_near_zero"])
    root = ET.fromstring(render_junit(r))
    [suite] = root.iter("testsuite")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d", suite.get("timestamp"))
    assert float(suite.get("time")) > 0
    cases = list(suite.iter("testcase"))
    assert [c.get("name") for c in cases] == ["no non-finite values", "step_log", "checkpoints", "replay",
                                              "tensor_spread"]
    assert all(float(c.get("time")) >= 0 for c in cases) and float(cases[3].get("time")) > 0
    assert all(r.directory not in c.get("name") + c.get("classname") for c in cases)
    assert {p.get("name"): p.get("value") for p in suite.iter("property")} == {"directory": r.directory}
    body = cases[0].find("failure").text
    assert "non-finite values began at step 17" in body and "features.gain" in body
    assert not re.search(r"^(#|\|)|<details>|\*\*", body, re.MULTILINE)  # plain text, not Markdown


def test_a_dash_is_stdout_for_every_report_and_only_one_may_take_it(tmp_path, runs):
    """``--markdown -`` prints the Markdown (it once wrote a file named "-"); two reports cannot share stdout."""
    result = run_cli("replay", runs["adam_near_zero"], "--no-explain", "--markdown", "-", cwd=tmp_path)
    assert result.code == 1, result.stderr
    assert result.stdout.startswith("## nanforensics replay: non-finite") and "╭" not in result.stdout
    assert not (tmp_path / "-").exists()
    both = run_cli("replay", runs["adam_near_zero"], "--json", "-", "--markdown", "-", cwd=tmp_path)
    assert both.code == 2 and both.stderr.count("\n") == 1 and "only one report can go to stdout" in both.stderr
    assert not (tmp_path / "-").exists()
