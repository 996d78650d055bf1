"""nanforensics report: a saved replay, bisect or post-mortem report re-rendered without replaying; the JSON
reports load back into their dataclasses exactly."""

from __future__ import annotations

import json

import pytest
from nanforensics.errors import BadInput
from nanforensics.report import to_json
from nanforensics.saved import load_report
from nanforensics.views.html import render_html
from nanforensics.views.report import render_markdown, render_terminal
from rich.console import Console

from conftest import assert_one_line_error, run_cli
from postmortem_cases import examined


def test_every_schema_round_trips(runs, tmp_path):
    """to_json -> load -> to_json is the identity, for a post-mortem and the replay and bisect reports inside it."""
    pm = examined(runs["adam_near_zero"])
    for name, report in (("postmortem", pm), ("replay", pm.replay), ("bisect", pm.checkpoints)):
        text = to_json(report)
        (tmp_path / f"{name}.json").write_text(text)
        loaded = load_report(tmp_path / f"{name}.json")
        assert type(loaded) is type(report) and to_json(loaded) == text, name
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
