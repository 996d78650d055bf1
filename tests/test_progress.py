"""A tool people leave running: progress on stderr that a CI log shows as plain lines, Ctrl-C that says what it
stopped, views of a 2000-step run that fit the width they are given, and the messages and flags of issue 22."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nanforensics.views.progress import INTERVAL_ENV, LogLines
from nanforensics.words import count, every

import scenarios
from conftest import ROOT, TESTS, assert_one_line_error, cli_command, error_lines, run_cli

LONG_STEPS, LONG_DEFECT, LONG_EVERY, AFTER = 2000, 1099, 1000, 120
P = "nanforensics: [replay] "  # the prefix of the replay's progress lines in a log
PROGRESS = re.compile(r"^nanforensics: \[replay\] (?P<phase>.+) \((?P<done>[\d,]+) of (?P<at_most>at most )?(?P<total>[\d,]+) "
                      r"(?P<unit>\w+)\), (?P<elapsed>[\d a-z]+) elapsed(, (about|at most) [\d a-z]+ left)?$")


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2000 steps, checkpoints at 0 and 1000, the defect at step 1099; training goes on with NaN to the end."""
    run = tmp_path_factory.mktemp("long") / "run"
    scenarios.record(run, "adam_near_zero", steps=LONG_STEPS, defect_step=LONG_DEFECT, checkpoint_every=LONG_EVERY)
    return run


def cli(*args: str | Path, cwd: Path | None = None, **env: str) -> subprocess.Popen[str]:
    """The real entry point with stdout and stderr pipes, as in a CI job."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen([*cli_command(), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "NO_COLOR": "1", "PYTHONPATH": path, **env}, cwd=cwd)


def phases(stderr: str) -> list[tuple[str, list[re.Match[str]]]]:
    """(phase line, its progress lines) in order; every line is one or the other."""
    out: list[tuple[str, list[re.Match[str]]]] = []
    for line in stderr.splitlines():
        if line.startswith("nanforensics: run code: "):
            continue
        assert line.startswith(P), line
        m = PROGRESS.match(line)
        if m is None or not out or not out[-1][0].startswith(f"{P}{m['phase']}"):
            out.append((line, []))
        else:
            out[-1][1].append(m)
    return out


@pytest.fixture(scope="module")
def long_replay(long_run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The long run replayed into a pipe, every progress update a line ($NANFORENSICS_PROGRESS_SECONDS=0), the
    replay going on 120 steps past the whole model turning non-finite (a long chain, spread and precursor window)."""
    out = tmp_path_factory.mktemp("long_report") / "report.json"
    # from the run's folder: the report's paths are short, as a user's are (a path is never broken across lines, so
    # pytest's long temporary one would set the width of the report's panel)
    p = cli("replay", long_run.name, "--after", str(AFTER), "--json", out, cwd=long_run.parent, **{INTERVAL_ENV: "0"})
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 1, stderr[-3000:]
    assert "NON-FINITE" in stdout  # the terminal view on stdout, progress on stderr
    return stderr, out


def test_progress_in_a_pipe_is_plain_lines_per_phase_with_true_totals(long_replay):
    stderr, out = long_replay
    import json

    report = json.loads(out.read_text())
    seen = phases(stderr)
    names = [line for line, _ in seen]
    stop = LONG_DEFECT + 2 + AFTER  # where the log says it ends at the latest: the NaN loss, a step, --after
    # the flagged step re-runs from the state kept before it: no phase re-runs the steps before it
    assert names[:3] == [f"{P}checking that the checkpoint at step {LONG_EVERY} is finite",
                         f"{P}checking the batches of steps {LONG_EVERY}-{LONG_STEPS - 1}",
                         f"{P}replaying steps {LONG_EVERY}-{stop} ({stop - LONG_EVERY + 1:,} steps)"]
    assert not [n for n in names if "re-running" in n]
    assert names[3].startswith(f"{P}locating: steps {LONG_DEFECT}-{stop}, reading each first non-finite value (at most ")
    assert any(n.startswith(f"{P}attributing samples of step {LONG_DEFECT}: passes of the whole step (at most ")
               for n in names)
    # the operation is traced first: its coordinates may point at the sample group testing starts from
    assert names[-2:] == [f"{P}tracing the operation behind grad at step {LONG_DEFECT}",
                          next(n for n in names if n.startswith(f"{P}attributing samples of step {LONG_DEFECT}"))]
    for line, updates in seen:
        if not updates:
            continue
        done = [int(m["done"].replace(",", "")) for m in updates]
        assert done == list(range(1, len(done) + 1)), line  # one line per unit at interval 0, in order
        assert all(int(m["total"].replace(",", "")) >= d for m, d in zip(updates, done)), line
    # the detecting pass stops at the flagged step; the locating one ends complete, at the step the replay stopped
    (_, detect), (_, locate) = seen[2], seen[3]
    assert len(detect) == LONG_DEFECT - LONG_EVERY
    last = locate[-1]
    assert last["done"] == last["total"] and last["at_most"] is None
    assert LONG_DEFECT + int(last["total"].replace(",", "")) - 1 == report["setup"]["last_step"]


def test_progress_lines_in_a_log_come_at_most_every_interval():
    """The log view's throttle, on its own clock: a phase line as each begins, then a line at most every 5 s."""
    now = [0.0]
    lines: list[str] = []
    view = LogLines(lines.append, "replay", interval=5.0, clock=lambda: now[0])
    view.phase("replaying steps 0-99", 100)
    for done in range(1, 101):
        now[0] += 0.5
        view.update(done)
    view.phase("tracing the operation behind grad at step 99")
    assert lines[0] == f"{P}replaying steps 0-99 (100 steps)"
    assert lines[-1] == f"{P}tracing the operation behind grad at step 99"
    progress = lines[1:-1]
    assert len(progress) == 10  # 50 s of work, a line every 5 s
    assert progress[0] == f"{P}replaying steps 0-99 (10 of 100 steps), 5 s elapsed, about 45 s left"
    assert progress[-1] == f"{P}replaying steps 0-99 (100 of 100 steps), 50 s elapsed"


def test_quiet_silences_progress(tmp_path):
    result = run_cli("replay", "sample_runs/seed_adam", "--quiet", "--no-explain", "--json", tmp_path / "r.json",
                     cwd=ROOT)
    assert result.code == 1 and error_lines(result.stderr) == [], result.stderr


@pytest.mark.parametrize("columns", [80, 200])
def test_a_2000_step_report_fits_the_width(long_replay, columns):
    _, out = long_replay
    import json

    report = json.loads(out.read_text())
    assert len(report["precursors"]) > columns and len({e["step"] for e in report["events"]}) > AFTER  # JSON keeps all
    result = run_cli("report", out, columns=columns)
    assert result.code == 0, result.stderr
    wide = [line for line in result.stdout.splitlines() if len(line) > columns]
    assert not wide, wide[:3]
    text = " ".join(result.stdout.split())
    assert "more (every one in the JSON report)" in text and "a character per" in text


def test_ctrl_c_says_what_it_interrupted_and_writes_nothing(long_run, tmp_path):
    out = tmp_path / "report.json"
    p = cli("replay", long_run, "--json", out, **{INTERVAL_ENV: "0"})
    assert p.stderr is not None
    for line in p.stderr:  # the replay is under way: a progress line of its steps
        if PROGRESS.match(line.rstrip("\n")) and "replaying steps" in line:
            break
    p.send_signal(signal.SIGINT)
    rest, stdout = p.stderr.read(), p.stdout.read()  # type: ignore[union-attr]
    assert p.wait(timeout=120) == 130, rest
    lines = rest.splitlines()
    assert "Traceback" not in rest and stdout == ""
    assert [line for line in lines if not PROGRESS.match(line)] == [lines[-1]]
    assert re.fullmatch(r"nanforensics: replay interrupted while replaying steps \d+-\d+ \([\d,]+ of [\d,]+ steps\); "
                        r"nothing was written", lines[-1]), lines[-1]
    assert not out.exists() and list(tmp_path.iterdir()) == []


# ---- messages and flags ----------------------------------------------------------------------------------------


def test_version_short_flag():
    assert run_cli("-V").stdout == run_cli("--version").stdout != ""


def test_from_step_past_the_run_is_refused():
    assert_one_line_error(run_cli("replay", "sample_runs/seed_adam", "--from-step", "999", cwd=ROOT),
                          "--from-step", "step 999 lies past the run's last logged step, 29")


def test_a_clean_replay_names_the_steps_it_did_not_check():
    result = run_cli("replay", "sample_runs/clean", "--json", "-", cwd=ROOT)
    assert result.code == 0, result.stderr
    assert any("steps before 30 were not replayed (`--from-step 0` replays from the start)" in f
               for f in result.json()["findings"])


def test_a_missing_script_names_the_folder_code_path_wants(tmp_path):
    result = run_cli("replay", ROOT / "sample_runs" / "seed_adam", cwd=tmp_path)
    assert_one_line_error(result, "script sample_runs/code/regressor.py does not exist here",
                          "--code-path DIR, DIR the folder that holds regressor.py itself")


def test_postmortem_code_path_outside_the_checkout(tmp_path):
    """Outside the repository the post-mortem cannot import the sample's code: its advice names its own option,
    and with --code-path (the script's folder) it replays."""
    sample = ROOT / "sample_runs" / "seed_adam"
    alone = run_cli("postmortem", sample, "--json", "-", cwd=tmp_path)
    assert alone.code == 1, alone.stderr
    advice = " ".join(alone.json()["findings"])
    assert f"`nanforensics postmortem {sample} --code-path DIR`" in advice and "--replay" not in advice
    given_code = run_cli("postmortem", sample, "--code-path", ROOT / "sample_runs" / "code", cwd=tmp_path)
    assert given_code.code == 1, given_code.stderr
    assert "responsible step 27" in given_code.stdout and "(or add --replay)" not in given_code.stdout


def test_report_of_a_file_that_is_no_report(tmp_path):
    other = tmp_path / "other.json"
    other.write_text('{"steps": []}')
    assert_one_line_error(run_cli("report", other), 'not a report nanforensics re-renders (no "schema" field;')


@given(st.integers(min_value=1, max_value=10**6))
def test_counts_agree_with_their_number(n):
    assert count(n, "thread") == (f"{n:,} threads" if n != 1 else "1 thread")
    assert count(n, "pass", "passes").endswith("passes" if n != 1 else "1 pass")
    assert every(n, "rank") == ("the one rank" if n == 1 else "both ranks" if n == 2 else f"all {n:,} ranks")
