"""The documentation's figures come from the committed benchmark results, and the README
keeps its shape.

``benchmarks/report.py --check`` regenerates docs/benchmarks.md and the README's headline
block from ``benchmarks/results/*.json`` and fails when either differs; these tests run
it on the repository and on a temporary copy with one figure changed (in the JSON, in
the page, in the README). They also run the README's example and hold the README to its
contract (title, one paragraph, the two commands, at most 250 lines), and look for
machine paths in the repository.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "benchmarks" / "report.py"


def run_report(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(root / "benchmarks" / "report.py"), *args],
                          cwd=root, capture_output=True, text=True, timeout=120)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """What report.py reads and writes, copied: the script, the results, the pages
    (benchmarks, guarantees' status), the README and the benchmark scripts (it lists
    those without a result)."""
    (tmp_path / "docs").mkdir()
    shutil.copytree(ROOT / "benchmarks", tmp_path / "benchmarks",
                    ignore=shutil.ignore_patterns("__pycache__", "*.png"))
    for page in ("benchmarks.md", "guarantees.md"):
        shutil.copy(ROOT / "docs" / page, tmp_path / "docs" / page)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def test_committed_docs_match_the_results():
    r = run_report(ROOT, "--check")
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_fails_when_a_result_changes(copy: Path):
    path = copy / "benchmarks" / "results" / "bench_gpu_memory.json"
    data = json.loads(path.read_text())
    data["chain"][0]["reserved_over_predicted"] = 9.87
    path.write_text(json.dumps(data))
    r = run_report(copy, "--check")
    assert r.returncode == 1
    assert "+| 0 |" in r.stdout and "| 9.87 |" in r.stdout   # the diff shows the new figure
    assert "differ from benchmarks/results" in r.stderr


def test_check_fails_when_a_documented_figure_is_edited(copy: Path):
    page = copy / "docs" / "benchmarks.md"
    text = page.read_text()
    figure = re.search(r"\| (\d+\.\d\d) \|", text)
    assert figure, "docs/benchmarks.md has no two-decimal figure to alter"
    page.write_text(text.replace(figure.group(0), "| 0.01 |", 1))
    r = run_report(copy, "--check")
    assert r.returncode == 1 and "-| " in r.stdout


def test_check_fails_when_a_readme_headline_is_edited(copy: Path):
    readme = copy / "README.md"
    text = readme.read_text()
    begin, end = text.index("<!-- report:headline -->"), text.index("<!-- /report:headline -->")
    block = text[begin:end]
    changed = re.sub(r"\d\.\d\d", "7.77", block, count=1)
    assert changed != block, "the README's headline block has no figure"
    readme.write_text(text[:begin] + changed + text[end:])
    r = run_report(copy, "--check")
    assert r.returncode == 1 and "README.md" in r.stdout
    assert run_report(copy).returncode == 0          # regenerating puts it back
    assert readme.read_text() == text


def test_readme_shape():
    text = (ROOT / "README.md").read_text()
    lines = text.split("\n")
    assert len(lines) <= 251, f"README.md has {len(lines)} lines (at most 250)"
    assert lines[0] == "# fxpipe" and lines[1] == ""
    blocks = re.findall(r"```(\w*)\n(.*?)```", text, re.S)
    before_first_block = text[:text.index("```")].strip().split("\n\n")
    assert len(before_first_block) == 2, "title, then one paragraph, then the two commands"
    lang, commands = blocks[0]
    assert lang == "bash" and len(commands.strip().split("\n")) == 2
    demo, suite = commands.strip().split("\n")
    assert demo.endswith("python -m fxpipe.demo")
    ci = (ROOT / ".ci" / "run").read_text()
    pytest_line = next(line for line in ci.splitlines() if "-m pytest" in line)
    assert suite.endswith(pytest_line.replace(' "$@"', "")), (suite, pytest_line)


def test_readme_example_runs():
    text = (ROOT / "README.md").read_text()
    example = text.split("## Example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    ns: dict = {}
    exec(compile(example, "README.md (Example)", "exec"), ns)  # noqa: S102 — the README's code
    try:
        loss = ns["loss"]
        assert loss.ndim == 0 and loss.isfinite()
        assert all(p.grad is not None for p in ns["model"].parameters())
    finally:
        ns["pipe"].close()


MACHINE_PATH = re.compile("/" + "(?:work|home)" + r"/\w")
SHARED = ".." + "/shared"   # the checkout beside the repository, which a clone lacks
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build"}


def test_no_machine_paths_in_the_repository():
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder, name)
            if path.suffix in (".png", ".pyc") or name in SKIP_DIRS:   # a worktree's .git is a file
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            found += [f"{path.relative_to(ROOT)}:{i}" for i, line in enumerate(text.splitlines(), 1)
                      if MACHINE_PATH.search(line) or SHARED in line]
    assert not found, f"machine paths (use paths relative to the repository): {found}"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_documentation_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "data" / "README.md"]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_record_stamps_the_command_and_keeps_one_run_per_result(copy: Path):
    script = copy / "benchmarks" / "bench_fake.py"
    script.write_text("import json, sys\nfrom pathlib import Path\n"
                      "out = Path('benchmarks/results/bench_fake.json')\n"
                      "old = json.loads(out.read_text()) if out.exists() else {}\n"
                      "old[sys.argv[1]] = float(sys.argv[2])\n"
                      "out.write_text(json.dumps(old))\n")
    record = [sys.executable, str(copy / "benchmarks" / "record.py"), "benchmarks/results/bench_fake.json", "--"]

    def runs(*args: str) -> list[dict]:
        subprocess.run([*record, sys.executable, "benchmarks/bench_fake.py", *args], cwd=copy,
                       check=True, capture_output=True, timeout=60)
        return json.loads((copy / "benchmarks" / "results" / "bench_fake.json").read_text())["runs"]

    (a,) = runs("a", "1")
    assert a["command"] == "python benchmarks/bench_fake.py a 1" and a["keys"] == ["a"]
    assert {"date", "commit", "machine", "load"} <= set(a)
    assert [r["keys"] for r in runs("b", "2")] == [["a"], ["b"]]
    # the same value again still comes from that command; another command replaces the first
    assert [r["command"] for r in runs("b", "2")][-1].endswith("b 2")
    assert [(r["command"][-3:], r["keys"]) for r in runs("a", "3")] == [("b 2", ["b"]), ("a 3", ["a"])]
    failed = subprocess.run([*record, sys.executable, "-c", "raise SystemExit(3)"], cwd=copy,
                            capture_output=True, text=True, timeout=60)
    assert failed.returncode == 3 and "nothing recorded" in failed.stderr


def test_check_fails_when_a_status_row_disagrees_with_the_results(copy: Path):
    """A GPU run recorded as failed turns its row from "ran on a GPU"; the committed page
    still says it ran, and the check fails on that row."""
    path = copy / "benchmarks" / "results" / "gpu_check.json"
    data = json.loads(path.read_text())
    lora = next(r for r in data["finetune"]["runs"]
                if r["mode"] == "lora" and r.get("stage_backend") is None)
    assert lora["ok"]
    lora["ok"] = False
    path.write_text(json.dumps(data))
    r = run_report(copy, "--check")
    assert r.returncode == 1 and "docs/guarantees.md" in r.stdout
    assert re.search(r"^-\| bf16 LoRA fine-tune.*\| ran on a GPU \|", r.stdout, re.M)
    assert re.search(r"^\+\| bf16 LoRA fine-tune.*failed on a GPU", r.stdout, re.M)


def test_check_fails_when_a_status_row_is_edited(copy: Path):
    page = copy / "docs" / "guarantees.md"
    text = page.read_text()
    assert "| CPU / cuda-sim only |" in text
    page.write_text(text.replace("| CPU / cuda-sim only |", "| ran on a GPU |", 1))
    r = run_report(copy, "--check")
    assert r.returncode == 1 and "docs/guarantees.md" in r.stdout
