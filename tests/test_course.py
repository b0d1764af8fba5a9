"""The course runner (k3lab.experiments.course) on tiny synthetic notebooks written into tmp_path."""

import nbformat
import pytest

from k3lab.__main__ import main
from k3lab.experiments.course import (
    CourseError,
    NotebookResult,
    find_notebooks,
    headline_of,
    notebook_parameters,
    parse_param_pairs,
    parse_value,
    plan_parameters,
    run_course,
    select_notebooks,
    summary_markdown,
)


def write_notebook(path, params_source, body_source):
    """A notebook with a tagged parameters cell and one body cell."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell(params_source)
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# synthetic"), params, nbformat.v4.new_code_cell(body_source)]
    nbformat.write(nb, str(path))
    return path


@pytest.fixture
def course(tmp_path):
    """Three notebooks: 00 succeeds and echoes its parameters, 01 defines steps, 03 fails."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    write_notebook(folder / "00_echo.ipynb", 'preset = "tiny"\ndevice = "auto"\nsizes = [1]\nname: str = "x"',
                   'print("HEADLINE: first")\nprint(f"HEADLINE: {preset} {device} {sizes!r} {type(sizes).__name__} {name}")')
    write_notebook(folder / "01_steps.ipynb", 'preset = "tiny"\nsteps = 10', 'print(f"HEADLINE: steps={steps!r}")')
    write_notebook(folder / "03_fail.ipynb", 'preset = "tiny"', 'raise RuntimeError("boom")')
    (folder / "notes.ipynb").write_text("{}")  # not NN_topic: ignored
    return folder


def test_parse_value_literals_and_fallback():
    assert parse_value("50") == 50 and isinstance(parse_value("50"), int)
    assert parse_value("3e-4") == 3e-4
    assert parse_value("True") is True
    assert parse_value("None") is None
    assert parse_value("[64, 128]") == [64, 128]
    assert parse_value("{'a': 1}") == {"a": 1}
    assert parse_value("'quoted'") == "quoted"
    assert parse_value("chunk") == "chunk"  # not a literal: the plain string
    assert parse_value("__import__('os')") == "__import__('os')"  # never evaluated
    with pytest.raises(CourseError, match="tuple"):
        parse_value("(1, 2)")  # papermill would hand a tuple over as a string
    with pytest.raises(CourseError, match="dict keys"):
        parse_value("{1: 2}")


def test_parse_param_pairs_rejects_bad_names_and_repeats():
    assert parse_param_pairs([["steps", "5"], ["mode", "chunk"]]) == {"steps": 5, "mode": "chunk"}
    with pytest.raises(CourseError, match="identifier"):
        parse_param_pairs([["bad-name", "1"]])
    with pytest.raises(CourseError, match="more than once"):
        parse_param_pairs([["steps", "1"], ["steps", "2"]])


def test_notebook_parameters_reads_the_tagged_cell(course):
    assert notebook_parameters(course / "00_echo.ipynb") == {"preset": "tiny", "device": "auto", "sizes": [1], "name": "x"}
    assert notebook_parameters(course / "01_steps.ipynb") == {"preset": "tiny", "steps": 10}


def test_find_and_select_notebooks(course):
    found = find_notebooks(course)
    assert list(found) == [0, 1, 3]
    assert [p.name for p in select_notebooks(found, "03,00")] == ["00_echo.ipynb", "03_fail.ipynb"]
    assert [p.name for p in select_notebooks(found, "1")] == ["01_steps.ipynb"]
    with pytest.raises(CourseError, match=r"no notebook numbered 02; available: 00, 01, 03"):
        select_notebooks(found, "00,02")
    with pytest.raises(CourseError, match="not a notebook number"):
        select_notebooks(found, "tour")


def test_plan_rejects_unknown_parameter_naming_allowed(course):
    paths = list(find_notebooks(course).values())
    plan = plan_parameters(paths, "small", "cpu", {"steps": 3})
    assert plan[course / "01_steps.ipynb"] == {"preset": "small", "steps": 3}
    assert plan[course / "00_echo.ipynb"] == {"preset": "small", "device": "cpu"}
    with pytest.raises(CourseError, match=r"-p stepz: .*allowed names: device, name, preset, sizes, steps"):
        plan_parameters(paths, "tiny", "auto", {"stepz": 3})
    with pytest.raises(CourseError, match="use --preset"):
        plan_parameters(paths, "tiny", "auto", {"preset": "small"})
    only_00 = [course / "00_echo.ipynb"]  # steps exists, but not in the selected notebook
    with pytest.raises(CourseError, match="no parameters cell defines 'steps'"):
        plan_parameters(only_00, "tiny", "auto", {"steps": 3})


def test_headline_is_last_marked_stdout_line():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="HEADLINE: old\nother\n"),
        nbformat.v4.new_output("stream", name="stderr", text="HEADLINE: not stdout\n"),
        nbformat.v4.new_output("stream", name="stdout", text="x\nHEADLINE: new one \n"),
    ]
    nb.cells = [cell]
    assert headline_of(nb) == "new one"
    assert headline_of(nbformat.v4.new_notebook()) == ""


def test_summary_markdown_table():
    rows = [NotebookResult("00_tour", "ok", 1.234, "K3 | 27,648 B/token"), NotebookResult("01_x", "failed", 2.0, "")]
    text = summary_markdown(rows, header="# title")
    assert text.splitlines()[:4] == ["# title", "", "| notebook | status | seconds | headline |", "|---|---|---:|---|"]
    assert "| 00_tour | ok | 1.2 | K3 \\| 27,648 B/token |" in text
    assert "| 01_x | failed | 2.0 | — |" in text
    assert text.rstrip().endswith("1/2 ok, 3.2 s in all")


def test_run_course_keeps_going_and_writes_summary(course, tmp_path, capsys):
    out = tmp_path / "runs"
    rc = main(["course", "--notebooks", str(course), "--out", str(out), "--device", "cpu", "--only", "03,00",
               "-p", "sizes", "[2, 3]", "-p", "name", "plain text"])
    assert rc == 1  # 03 failed
    summary = (out / "summary.md").read_text()
    assert "| 00_echo | ok |" in summary and "tiny cpu [2, 3] list plain text" in summary
    assert "| 03_fail | failed |" in summary and "RuntimeError: boom" in summary
    assert summary.index("00_echo") < summary.index("03_fail")  # course order, not --only order
    assert {p.name for p in out.iterdir()} == {"00_echo.ipynb", "03_fail.ipynb", "summary.md"}
    assert "summary.md" in capsys.readouterr().out


def test_usage_errors_exit_2_before_running(course, tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(["course", "--notebooks", str(course), "--out", str(out), "-p", "stepz", "1"]) == 2
    assert "stepz" in capsys.readouterr().err
    assert main(["course", "--notebooks", str(course), "--out", str(out), "--only", "07"]) == 2
    assert main(["course", "--notebooks", str(course), "--out", str(out), "--preset", "k3"]) == 2
    assert main(["course", "--notebooks", str(course), "--out", str(course)]) == 2
    assert main([]) == 2
    assert not out.exists()  # nothing ran


def test_run_course_only_subset(course, tmp_path):
    results = run_course(course, tmp_path / "runs", only="01", params={"steps": 2})
    assert [(r.name, r.status, r.headline) for r in results] == [("01_steps", "ok", "steps=2")]


def test_every_course_notebook_accepts_the_course_default_device():
    """``python -m k3lab course`` passes ``device="auto"`` to every notebook that has a ``device``
    parameter: each one's ``check_param("device", ...)`` must allow it (notebook 12 once allowed only
    cpu/cuda, and the README's course command failed there)."""
    import re
    from pathlib import Path

    from k3lab.config import DEVICES

    notebooks = find_notebooks(Path(__file__).resolve().parents[1] / "notebooks")
    assert len(notebooks) >= 15
    checked = 0
    for path in notebooks.values():
        source = "\n".join(c.source for c in nbformat.read(str(path), as_version=4).cells if c.cell_type == "code")
        if "device" not in notebook_parameters(path):
            continue
        for call in re.findall(r'check_param\("device", device, choices=([^)\n]*\)?)\)', source):
            checked += 1
            allowed = DEVICES if call.strip() == "DEVICES" else eval(call, {"DEVICES": DEVICES})  # noqa: S307
            assert "auto" in allowed, f"{path.name}: device choices {allowed} lack the course's 'auto'"
    assert checked >= 1


def _git(cwd, *args):
    import subprocess

    subprocess.run(["git", "-c", "user.name=k3lab test", "-c", "user.email=test@example.invalid",
                    "-c", "commit.gpgsign=false", *args], cwd=cwd, check=True, capture_output=True)


def test_course_names_edited_notebooks_and_how_to_reset(course, tmp_path, capsys, monkeypatch):
    """Inside a git checkout, ``course --list`` (and ``course``) print one line naming the notebooks that differ from
    the last commit and the ``git checkout`` that resets them; a new notebook is not an edit; outside a checkout, no
    line."""
    import shutil

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GIT_DIR", raising=False)
    monkeypatch.delenv("GIT_WORK_TREE", raising=False)
    assert main(["course", "--notebooks", str(course), "--list"]) == 0
    assert "edited" not in capsys.readouterr().out  # tmp_path is no checkout: nothing to say

    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "notebooks")
    _git(tmp_path, "commit", "-q", "-m", "course")
    assert main(["course", "--notebooks", str(course), "--list"]) == 0
    assert "edited" not in capsys.readouterr().out  # clean checkout: nothing to say

    write_notebook(course / "01_steps.ipynb", 'preset = "tiny"\nsteps = 99', 'print("tried this")')  # a Try-this edit
    write_notebook(course / "05_mine.ipynb", 'preset = "tiny"', 'print(1)')  # the learner's own, untracked
    assert main(["course", "--notebooks", str(course), "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    notes = [line for line in out if "edited" in line]
    edited = "notebooks/{}".format("01_steps.ipynb")  # relative to the working directory (tmp_path)
    assert notes == [out[0]] and edited in notes[0], out
    assert f"git checkout -- {edited}" in notes[0] and "05_mine" not in notes[0] and "00_echo" not in notes[0]
    assert "01_steps.ipynb: preset='tiny', steps=99" in out  # the listing shows the edited defaults

    results = run_course(course, tmp_path / "runs", only="00")  # the course run says it too, before running
    assert results[0].status == "ok"
    assert f"note: edited since the last commit (run as edited): {edited}" in capsys.readouterr().out
