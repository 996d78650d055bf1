"""nanforensics postmortem: the example CI workflow's own command line, every analysis the directory allows,
and why not the others; the HTML report in a real browser."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

from nanforensics.postmortem import CHECKPOINTS, DONE, FAILED, REPLAY, SKIPPED, STEP_LOG, TENSOR_SPREAD, postmortem
from nanforensics.replay.spread import SpreadMap, TensorSpread, grouped, layered
from nanforensics.views import heatmap
from nanforensics.views.html import render_html
from nanforensics.views.markdown import render_postmortem as render_markdown
from nanforensics.views.postmortem import render_junit

import scenarios
from conftest import DEFECT_STEP, ROOT, assert_one_line_error, run_cli, tree_digest
from postmortem_cases import examined

WORKFLOW = ROOT / "docs" / "github-actions-postmortem.yml"
F = scenarios.DEFECT_FEATURE


def workflow_command() -> list[str]:
    """The post-mortem step's command line, as the example workflow writes it."""
    [line] = re.findall(r"^\s*run:\s*(nanforensics postmortem\b.*)$", WORKFLOW.read_text(), re.MULTILINE)
    return shlex.split(line)


def statuses(report) -> dict[str, str]:
    return {a.name: a.status for a in report.analyses}


def test_the_example_workflow_command_on_a_sample_run(tmp_path, monkeypatch):
    """The workflow downloads the failed job's run to artifact/run and runs this line in the checkout."""
    command = workflow_command()
    assert command[0] == "nanforensics"
    run = tmp_path / "artifact" / "run"
    shutil.copytree(ROOT / "sample_runs" / "seed_adam", run)
    (tmp_path / "sample_runs" / "code").mkdir(parents=True)  # the checkout: the sample's code is shipped beside it
    shutil.copy(ROOT / "sample_runs" / "code" / "regressor.py", tmp_path / "sample_runs" / "code")
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step's summary\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    before = tree_digest(run)

    result = run_cli(*command[1:], cwd=tmp_path)

    assert result.code == 1, result.stderr
    assert tree_digest(run) == before
    assert "responsible step 27" in result.stdout and "features.gain" in result.stdout
    report = json.loads((tmp_path / "reports" / "postmortem.json").read_text())
    assert report["schema"] == "nanforensics.postmortem/1" and report["verdict"] == "nonfinite"
    assert report["responsible_step"] == 27 and report["replay"]["origin"]["index"] == [F]
    assert [a["status"] for a in report["analyses"]] == [DONE] * 4
    text = summary.read_text()  # appended, after the earlier step's
    assert text.startswith("earlier step's summary\n## nanforensics post-mortem: non-finite")
    suite = ET.parse(tmp_path / "reports" / "postmortem.xml").getroot()
    [failure] = suite.iter("failure")
    assert "step 27" in failure.get("message") and "step_00000027.safetensors" in failure.get("message")
    assert (tmp_path / "reports" / "postmortem.html").read_text().startswith("<!DOCTYPE html>")


def test_seed_case_pins_the_step_and_maps_the_spread(runs):
    run = runs["adam_near_zero"]
    before = tree_digest(run)
    r = examined(run)
    assert tree_digest(run) == before
    assert statuses(r) == {STEP_LOG: DONE, CHECKPOINTS: DONE, REPLAY: DONE, TENSOR_SPREAD: DONE}
    assert (r.verdict, r.kind, r.responsible_step, r.window) == ("nonfinite", "run", DEFECT_STEP, None)
    assert r.step_log.first_nonfinite_loss_step == DEFECT_STEP + 1
    assert (r.checkpoints.last_clean.step, r.checkpoints.first_poisoned.step) == (10, 20)
    m = r.tensor_spread
    assert m.steps[0] == DEFECT_STEP - 2 and m.steps[-1] == r.replay.setup.last_step
    rows = {row.name: row for row in m.rows}
    at = m.steps.index(DEFECT_STEP)
    assert rows["features.gain"].params_nonfinite[at] == 1 and rows["features.gain"].state_nonfinite[at] == 2
    assert all(row.params_nonfinite[at] == 0 for name, row in rows.items() if name != "features.gain")
    assert all(row.params_nonfinite[at + 1] == row.params_total for row in m.rows)
    totals = {s.step: (s.params_nonfinite, s.state_nonfinite) for s in r.replay.spread}
    for i, step in enumerate(m.steps):  # the per-tensor re-run agrees with the replay's totals
        assert totals[step] == (sum(row.params_nonfinite[i] for row in m.rows),
                                sum(row.state_nonfinite[i] for row in m.rows))
    assert "▼" in heatmap.render_text(m) and "features.gain" in render_markdown(r)


def test_checkpoint_only_when_the_step_function_is_not_importable(copy_run):
    run = copy_run("adam_near_zero")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["step_fn"] = "train:step"
    (run / "manifest.json").write_text(json.dumps(manifest))
    before = tree_digest(run)
    r = postmortem(run)
    assert tree_digest(run) == before
    assert statuses(r) == {STEP_LOG: DONE, CHECKPOINTS: DONE, REPLAY: SKIPPED, TENSOR_SPREAD: SKIPPED}
    assert r.analysis(REPLAY).detail.startswith("step_fn `train:step` is not importable here")
    assert r.analysis(REPLAY).detail.endswith("checkpoint-only analysis")
    # checkpoint 10 clean, 20 poisoned, logged loss NaN at 18: the origin lies in steps 10-18
    assert (r.verdict, r.responsible_step, r.window.first, r.window.last) == ("nonfinite", None, 10, DEFECT_STEP + 1)
    assert "steps 10-18" in r.headline and any("--code-path" in f for f in r.findings)
    [failure] = ET.fromstring(render_junit(r)).iter("failure")
    assert "steps 10-18" in failure.get("message")
    skipped = {c.get("name"): c.find("skipped").get("message") for c in ET.fromstring(render_junit(r)).iter("testcase")
               if c.find("skipped") is not None}
    assert "train:step" in skipped[REPLAY]


def test_a_folder_of_checkpoints_alone(runs):
    folder = runs["adam_near_zero"] / "checkpoints"
    r = postmortem(folder)
    assert r.kind == "checkpoints" and statuses(r)[CHECKPOINTS] == DONE
    assert statuses(r)[STEP_LOG] == SKIPPED and "not a run recorded by nanforensics" in r.analysis(REPLAY).detail
    assert (r.verdict, r.window.first, r.window.last) == ("nonfinite", 10, 19)


def test_a_broken_manifest_still_gets_the_checkpoints_read(copy_run):
    run = copy_run("adam_near_zero")
    (run / "manifest.json").write_text('{"format": "nanforensics.run/1"')  # cut short
    r = postmortem(run)
    assert statuses(r) == {STEP_LOG: FAILED, CHECKPOINTS: DONE, REPLAY: SKIPPED, TENSOR_SPREAD: SKIPPED}
    assert "manifest.json: not valid JSON" in r.analysis(STEP_LOG).detail
    assert (r.kind, r.verdict, r.window.first, r.window.last) == ("run", "nonfinite", 10, 19)


def test_checkpoints_that_do_not_bracket_the_origin(runs, tmp_path):
    """A poisoned checkpoint before a clean one (a restart?): reported, not bisected through."""
    source = runs["adam_near_zero"] / "checkpoints"
    for step, copied in ((0, 20), (10, 10)):
        dest = tmp_path / f"step_{step:08d}"
        shutil.copytree(source / f"step_{copied:08d}", dest)
        meta = json.loads((dest / "meta.json").read_text())
        (dest / "meta.json").write_text(json.dumps({**meta, "step": step}))
    r = postmortem(tmp_path)
    assert (r.verdict, r.window, r.checkpoints.verdict) == ("nonfinite", None, "non_monotonic")
    assert "not monotonic" in r.headline


def test_clean_and_not_reproduced(runs, copy_run):
    assert postmortem(runs["clean"]).verdict == "clean"
    run = copy_run("clean")
    lines = (run / "steps.jsonl").read_text().splitlines()
    lines[20] = json.dumps({"step": 20, "loss": "nan"})  # a logging bug: the run itself stayed finite
    (run / "steps.jsonl").write_text("\n".join(lines) + "\n")
    r = postmortem(run)
    assert r.verdict == "not_reproduced" and statuses(r)[REPLAY] == DONE and r.replay.verdict == "not_reproduced"
    assert "does not reproduce" in r.headline


def test_cli_exit_codes_and_nothing_written_into_the_run(runs, tmp_path, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    clean = runs["clean"]
    before = tree_digest(clean)
    result = run_cli("postmortem", clean, "--markdown", tmp_path / "summary.md")
    assert result.code == 0, result.stderr
    assert (tmp_path / "summary.md").read_text().startswith("## nanforensics post-mortem: clean")
    inside = run_cli("postmortem", clean, "--html", clean / "report.html")
    assert_one_line_error(inside, "--html", "never writes into")
    assert tree_digest(clean) == before


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def test_html_is_self_contained(runs):
    page = render_html(examined(runs["adam_near_zero"]))
    parser = _Tags()
    parser.feed(page)
    parser.close()
    names = [t for t, _ in parser.tags]
    assert {"script", "link", "img", "iframe", "object"}.isdisjoint(names)
    assert not any(v and re.match(r"\s*(https?:|//)", v) for _, attrs in parser.tags for v in attrs.values())
    assert "url(" not in page and "@import" not in page
    assert names.count("svg") == 3  # the heatmap, the loss curve, the precursor curves
    assert page.count("<rect") >= 2 * 7 * 5 and "features.gain" in page


def test_heatmap_levels_and_layers():
    assert [heatmap.level(b, 100) for b in (0, 1, 2, 49, 50, 99, 100)] == [0, 1, 2, 2, 3, 3, 4]
    rows = [TensorSpread(f"layers.{i}.{p}", 10, 20, [0, i % 2], [0, 0]) for i in range(30) for p in ("w", "b")]
    g = grouped(SpreadMap([5, 6], rows, 6, "per_tensor"), 24)  # 30 layers: runs of neighbours
    assert [r.name for r in g][:2] == ["layers.0 .. layers.1", "layers.2 .. layers.3"] and len(g) == 15
    g = grouped(SpreadMap([5, 6], rows[:20], 6, "per_tensor"), 12)
    assert [r.name for r in g] == [f"layers.{i}" for i in range(10)]
    assert (g[1].params_total, g[1].params_nonfinite) == (20, [0, 2])
    # the library merges once (spread.layered); the views draw those rows and merge nothing themselves
    m = layered(SpreadMap([5, 6], rows, 6, "per_tensor"))
    assert (len(m.rows), len(m.text_rows), len(m.page_rows)) == (60, 15, 30)
    text = heatmap.render_text(m)
    assert "layers.0 .. layers.1" in text and "60 tensors shown as 15 layers" in text
    m.text_rows = m.text_rows[:1]  # what a view draws is the report's rows, not a grouping of its own
    assert "layers.2 .. layers.3" not in heatmap.render_text(m)
