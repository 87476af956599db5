"""Imports flow one way: app -> jobs -> core (STYLE.md principle 1)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    # core is the library: no UI, no storage, no job runner
    "core": {"app", "jobs", "gradio", "sqlalchemy", "alembic", "plotly"},
    # jobs persists and runs; it never reaches up into the UI
    "jobs": {"app", "gradio"},
    # the web process must start in seconds: no deep-learning stack in it
    "app": {"torch", "diffusers", "transformers", "peft", "cvxpy", "matplotlib"},
}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_flow_one_way(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no Python files"
    bad = {str(f.relative_to(ROOT)): sorted(imported_top_levels(f) & FORBIDDEN[package]) for f in files}
    bad = {f: names for f, names in bad.items() if names}
    assert not bad, f"{package} must not import {sorted(FORBIDDEN[package])}: {bad}"


def test_the_checker_sees_imports(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("import torch.nn\nfrom gradio import Blocks\nfrom . import sibling\n")
    assert imported_top_levels(sample) == {"torch", "gradio"}
