"""Packaging and layout (DESIGN.md, Layout): namespace subpackages, wheel contents, import direction."""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOP = ["platform", "kernels", "serve", "datagen", "training", "jobs"]
# Which top-level subpackages each one may import (DESIGN.md: kernels <- platform <- {serve, datagen, training} <- jobs).
ALLOWED = {
    "kernels": set(),
    "platform": {"kernels"},
    "serve": {"kernels", "platform"},
    "datagen": {"kernels", "platform", "serve"},
    "training": {"kernels", "platform"},
    "jobs": {"kernels", "platform", "serve", "datagen", "training"},
}


def _modules() -> list[Path]:
    return sorted(p for d in TOP for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("folder", TOP)
def test_top_level_folders_are_namespace_packages(folder):
    assert (REPO / folder).is_dir()
    assert not (REPO / folder / "__init__.py").exists(), f"{folder}/__init__.py would shadow stdlib/PyPI names"


def test_stdlib_platform_not_shadowed_from_repo_root():
    code = "import platform, sys; assert platform.system(); print(platform.__file__)"
    for args in (["-c", code], ["-m", "eagleray.platform.errors"]):
        out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "site-packages" not in out.stdout and str(REPO / "platform") not in out.stdout


def test_every_subpackage_imports_from_elsewhere(tmp_path):
    names = ["eagleray"] + [f"eagleray.{d}" for d in TOP]
    code = "import importlib\nfor n in %r: importlib.import_module(n)\nimport eagleray.platform.checkpoints.guard, eagleray.jobs.cli" % names
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        for n in names:
            parts = n.split(".")
            if parts[0] == "eagleray" and len(parts) > 1 and parts[1] in TOP:
                found.add(parts[1])
    return found


def test_import_direction():
    bad = []
    for path in _modules():
        owner = path.relative_to(REPO).parts[0]
        for dep in _imports(path) - {owner}:
            if dep not in ALLOWED[owner]:
                bad.append(f"{path.relative_to(REPO)} imports eagleray.{dep}")
    assert not bad, "import-direction violations:\n" + "\n".join(bad)


def test_wheel_contains_every_module(tmp_path):
    out = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(REPO)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # `make install` showed setuptools' 40-line warning ("'eagleray.jobs.configs' is absent from the `packages`")
    assert "Warning" not in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
    wheel = next(tmp_path.glob("eagleray-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {"eagleray/__init__.py"} | {"eagleray/" + str(p.relative_to(REPO)) for p in _modules()}
    want |= {"eagleray/" + str(p.relative_to(REPO)) for p in (REPO / "jobs" / "configs").glob("*.yaml")}
    want |= {"eagleray/" + str(p.relative_to(REPO)) for p in (REPO / "kernels").glob("*.c")}  # built at first use
    missing = sorted(want - names)
    assert not missing, f"wheel lacks {missing}"
    assert not any(n.startswith("eagleray/tests/") for n in names)


def test_pyproject_lists_exactly_the_package_folders():
    import tomllib
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"eagleray"} | {"eagleray." + ".".join(p.parent.relative_to(REPO).parts) for p in _modules()}
    found.add("eagleray.jobs.configs")  # package data only (the shipped YAML configs)
    assert listed == found, f"missing from pyproject: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"
