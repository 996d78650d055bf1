"""nanforensics report: a saved replay, bisect or post-mortem report re-rendered without replaying; the JSON
reports load back into their dataclasses exactly."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from typing import Any, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nanforensics.errors import BadInput
from nanforensics.postmortem import PostmortemReport
from nanforensics.report import to_json
from nanforensics.saved import load_report
from nanforensics.schema import load
from nanforensics.views.html import render_html
from nanforensics.views.markdown import render as render_markdown
from nanforensics.views.report import render_terminal
from rich.console import Console

from conftest import ROOT, assert_one_line_error, run_cli
from postmortem_cases import examined


def test_every_schema_round_trips(runs, tmp_path):
    """to_json -> load -> to_json is the identity, for a post-mortem and the replay and bisect reports inside it."""
    pm = examined(runs["adam_near_zero"])
    for name, report in (("postmortem", pm), ("replay", pm.replay), ("bisect", pm.checkpoints)):
        text = to_json(report)
        (tmp_path / f"{name}.json").write_text(text)
        loaded = load_report(tmp_path / f"{name}.json")
        assert type(loaded) is type(report) and to_json(loaded) == text, name
        # what a reader meets first: the schema; then every level indented by two spaces, the file ending in a newline
        assert next(iter(json.loads(text))) == "schema" and text == json.dumps(json.loads(text), indent=2) + "\n", name
    again = load_report(tmp_path / "postmortem.json")
    assert again.replay.origin.index == [3] and again.tensor_spread.rows[0].name == "features.gain"


def test_report_rerenders_a_post_mortem_whose_run_is_gone(runs, tmp_path):
    data = json.loads(to_json(examined(runs["adam_near_zero"])))
    data["directory"] = data["replay"]["setup"]["run"] = str(tmp_path / "deleted-run")  # nothing left to read
    saved = tmp_path / "postmortem.json"
    saved.write_text(json.dumps(data))
    result = run_cli("report", saved, "--markdown", tmp_path / "r.md", "--html", tmp_path / "r.html")
    assert result.code == 0, result.stderr
    assert "non-finite values began at step 17" in result.stdout and "features.gain" in result.stdout
    loaded = load_report(saved)
    assert (tmp_path / "r.md").read_text() == render_markdown(loaded)
    assert (tmp_path / "r.html").read_text() == render_html(loaded)


def test_a_replay_report_rerenders_with_its_whole_model_spread(runs):
    replay = examined(runs["adam_near_zero"]).replay
    console = Console(record=True, width=120, color_system=None)
    render_terminal(replay, console)
    text = console.export_text()
    assert "responsible step 17" in text and "whole model" in text and "▼" in text
    assert render_markdown(replay).startswith("## nanforensics replay: non-finite")
    assert "whole model" in render_html(replay)


def test_report_prints_what_replay_printed(tmp_path):
    """The saved report re-rendered is the command's own terminal view, the spread heatmap included."""
    shown = run_cli("replay", ROOT / "sample_runs" / "seed_adam", "--json", tmp_path / "r.json")
    again = run_cli("report", tmp_path / "r.json")
    assert shown.code == 1 and again.code == 0, (shown.stderr, again.stderr)
    assert again.stdout == shown.stdout and "spread of non-finite values" in shown.stdout


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.update(schema="nanforensics.postmortem/2"), "upgrade"),
    (lambda d: d.update(schema="somebody.else/1"), "not a report nanforensics re-renders"),
    (lambda d: d["replay"]["origin"].update(step="seventeen"),
     "report.replay.origin.step: expected an integer, found a string 'seventeen'"),
    (lambda d: d.pop("verdict"), "field 'verdict' is missing"),
])
def test_refusals_name_the_problem(runs, tmp_path, edit, needle):
    data = json.loads(to_json(examined(runs["adam_near_zero"])))
    edit(data)
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps(data))
    with pytest.raises(BadInput, match=needle.replace(".", r"\.").replace("(", r"\(")):
        load_report(saved)


def test_cli_refusal_is_one_line(tmp_path):
    saved = tmp_path / "r.json"
    saved.write_text('{"schema": "nanforensics.replay/7"}')
    assert_one_line_error(run_cli("report", saved), "r.json", "nanforensics.replay/1")


# ---- closed sets of words: every field typed Literal, found from the types, refuses any other value ----------

def _closed_fields(kind: Any, data: Any, path: tuple[Any, ...] = (), nullable: bool = False
                   ) -> Iterator[tuple[tuple[Any, ...], tuple[str | None, ...]]]:
    """(where in ``data``, the values allowed) for every field of ``data`` whose type is a Literal (or an optional
    one), walking the report's dataclasses and the JSON side by side."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, typing.get_origin(int | None)):
        options = [a for a in args if a is not type(None)]
        if data is not None and len(options) == 1:
            yield from _closed_fields(options[0], data, path, nullable=type(None) in args)
    elif origin is typing.Literal:
        yield path, args + ((None,) if nullable else ())
    elif dataclasses.is_dataclass(kind) and isinstance(data, dict):
        hints = typing.get_type_hints(kind)
        for f in dataclasses.fields(kind):
            if f.name in data:
                yield from _closed_fields(hints[f.name], data[f.name], (*path, f.name))
    elif origin is list and isinstance(data, list):
        for i, item in enumerate(data):
            yield from _closed_fields(args[0], item, (*path, i))


@pytest.fixture(scope="module")
def saved_postmortem(runs) -> dict[str, Any]:
    return json.loads(to_json(examined(runs["adam_near_zero"])))


def test_the_saved_report_has_closed_fields_to_test(saved_postmortem):
    found = {p[-1] for p, _ in _closed_fields(PostmortemReport, saved_postmortem)}
    assert {"verdict", "stage", "first_poisoned_verdict"} <= found, found


@settings(max_examples=60, deadline=None)
@given(pick=st.integers(min_value=0), word=st.one_of(st.text(max_size=12), st.integers(), st.none(), st.booleans()))
def test_a_word_outside_a_closed_set_is_refused_by_name(saved_postmortem, pick, word):
    """The views look these words up in tables: a saved report with any other value in any such field is refused on
    loading, naming the field, instead of failing as a KeyError in a view."""
    fields = list(_closed_fields(PostmortemReport, saved_postmortem))
    path, allowed = fields[pick % len(fields)]
    if word in allowed:
        return
    data = json.loads(json.dumps(saved_postmortem))
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = word
    where = "report" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)
    with pytest.raises(BadInput, match=f"^r.json: {re.escape(where)}: "):
        load(PostmortemReport, data, "r.json", "report")  # what load_report calls on the file's JSON
