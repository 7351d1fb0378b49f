"""The documentation holds together: README.md stays short and keeps its two set-up commands,
every relative link in README.md and docs/ leads to a file and heading that exist, no page is
a dated diary, every command and option of the CLI is in docs/cli.md, docs/models.md is what
``tests/zoo.py`` makes from the committed results (docs/models.json), and set-up command 1
installs what the README says it does (ONNX Runtime at the test extra's pin, no torch, no
TensorFlow)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

import zoo

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: README set-up command 1 (install, run and verify the example) and command 2 (.ci/run greps it)
SETUP_COMMANDS = (
    "pip install -r requirements.txt && irgen run examples/tiny_cnn.onnx -o out && irgen verify out",
    "pip install -r requirements-test.txt && python -m pytest",
)


def test_readme_is_short_and_holds_the_setup_commands():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move reference material to docs/"
    for command in SETUP_COMMANDS:
        assert command in lines, f"README.md lost the line {command!r}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(dest), f"{page.name}: link to {target}: no such heading in {dest.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_is_a_dated_diary(page):
    """Reference, not a run diary: what holds of the code, not when someone tried it."""
    dates = re.findall(r"\b20\d\d-[01]\d-[0-3]\d\b", page.read_text(encoding="utf-8"))
    assert not dates, f"{page.name}: dates {dates[:3]}: write what is true now, without the history"


def test_every_command_and_option_is_in_the_cli_reference():
    from irgen.cli import build_parser
    from irgen.plugins import PluginHost

    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    parser = build_parser(PluginHost().load())
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    missing = []
    for name, sub in commands.choices.items():
        if f"`irgen {name}" not in doc:
            missing.append(f"irgen {name}")
        for action in sub._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help" \
                        and not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", doc):
                    missing.append(f"irgen {name} {option}")
    assert not missing, f"docs/cli.md does not document: {missing}"


def test_models_page_is_what_the_zoo_makes_of_the_results():
    rows = zoo.load_results()
    assert rows and all(set(r) <= set(zoo.RESULT_FIELDS) for r in rows)
    assert {r["status"] for r in rows} <= {"pass", "pass-no-source", "fail", "error"}
    assert zoo.RESULTS.read_text(encoding="utf-8") == zoo.dump_results(rows), \
        "docs/models.json is not in the form tests/zoo.py writes (one row a line)"
    page = zoo.MODELS_PAGE.read_text(encoding="utf-8")
    assert page == zoo.render_page(page, rows), \
        "docs/models.md's table is not what docs/models.json makes: run python tests/zoo.py --render"


def test_merged_rows_replace_their_case_and_keep_the_zoo_order():
    rows = zoo.load_results()
    first = {**rows[0], "status": "fail", "error": "x"}
    new = {"case": "resnet18-onnx", "model": "resnet18", "format": "onnx", "opt_level": 2, "status": "error",
           "error": "a|b"}
    merged = zoo.merge_results(rows, [first, new])
    assert len(merged) == len(rows) + 1 and merged[0] == first
    assert merged.index(new) < [r["case"] for r in merged].index("resnet18-pt2")
    assert "fails: a\\|b" in zoo.table([new])


def _requirements(name: str) -> list[str]:
    lines = (ROOT / name).read_text(encoding="utf-8").splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def test_setup_command_1_installs_onnxruntime_and_neither_torch_nor_tensorflow():
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pins = dict(req.split("==") for req in test_extra if "==" in req)
    lean = _requirements("requirements.txt")
    assert f"onnxruntime=={pins['onnxruntime']}" in lean
    assert "./plugins/frontends/onnx" in lean
    assert not [r for r in lean if re.search(r"torch|tensorflow", r)], lean
    torch = _requirements("requirements-torch.txt")
    assert f"torch=={pins['torch']}" in torch and "-r requirements.txt" in torch
    tensorflow = _requirements("requirements-tensorflow.txt")
    assert "./plugins/frontends/tensorflow[keras]" in tensorflow and "-r requirements.txt" in tensorflow
