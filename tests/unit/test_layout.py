"""Packaging and layout (docs/architecture.md): namespace subpackages, wheel contents, the import rules, ruff."""

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOP = ["platform", "kernels", "serve", "datagen", "training", "jobs"]
PRODUCT = {"kernels", "platform", "serve.engine", "serve", "datagen", "training", "jobs"}
# The import rules (docs/architecture.md): each layer, and the layers it may import. A module belongs
# to the longest layer name that prefixes its dotted path; so does what it imports. No exceptions.
LAYERS = {
    "kernels": set(),
    "platform": {"kernels"},
    "serve.engine": {"kernels", "platform"},
    "serve": {"kernels", "platform", "serve.engine"},
    "datagen": {"kernels", "platform", "serve.engine"},
    "training": {"kernels", "platform"},
    "tests.support": {"kernels", "platform", "serve.engine", "serve", "datagen", "training"},
    "jobs": {"kernels", "platform", "serve.engine", "serve", "datagen", "training", "jobs"},
    "jobs.bench": PRODUCT | {"jobs.bench", "tests.support"},
    "jobs.cli": PRODUCT | {"jobs.bench", "jobs.cli"},
}
ENGINE_API = "serve.engine"  # outside serve/engine/ the engine is imported as this package only, never a module in it
MODULE_NAME = re.compile(r"eagleray(\.[a-z_][a-z0-9_]*)+")


def _modules(folders=TOP) -> list[Path]:
    return sorted(p for d in folders for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)


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
    code = (
        "import importlib\nfor n in %r: importlib.import_module(n)\nimport eagleray.platform.checkpoints.guard, eagleray.jobs.cli"
        % names
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def _dotted(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    p = REPO.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or p.is_dir()


def _imports(path: Path) -> set[str]:
    """Dotted names (without ``eagleray.``) of the eagleray modules ``path`` imports: import statements
    (``from pkg import module`` counts as the module) and module names in string constants (importlib)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {
                f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}".removeprefix("eagleray.")) else node.module
                for a in node.names
            }
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.fullmatch(node.value):
            found.add(node.value)
    return {n.removeprefix("eagleray.") for n in found if n.startswith("eagleray.") and _is_module(n.removeprefix("eagleray."))}


def _layer(dotted: str) -> str | None:
    return max((name for name in LAYERS if dotted == name or dotted.startswith(name + ".")), key=len, default=None)


def import_violations(paths: list[Path]) -> list[str]:
    bad = []
    for path in paths:
        me = _dotted(path)
        own = _layer(me)
        for dep in sorted(_imports(path)):
            theirs = _layer(dep)
            where = f"{path.relative_to(REPO)} imports eagleray.{dep}"
            if theirs is None:
                bad.append(f"{where}: not in any layer")
            elif theirs != own and theirs not in LAYERS[own]:
                bad.append(f"{where}: layer {own} may import only {sorted(LAYERS[own]) or 'nothing'}")
            if dep.startswith(ENGINE_API + ".") and _layer(me) != ENGINE_API:
                bad.append(f"{where}: outside serve/engine/ import the public API, eagleray.{ENGINE_API}")
    return bad


def test_every_module_is_in_a_layer():
    paths = _modules([*TOP, "tests/support"])
    assert all(_layer(_dotted(p)) for p in paths), [str(p) for p in paths if not _layer(_dotted(p))]


def test_import_rules():
    bad = import_violations(_modules([*TOP, "tests/support"]))
    assert not bad, "import-rule violations (docs/architecture.md):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "code, rel, want",
    [
        ("from eagleray.serve.engine import LLMEngine", "datagen/x.py", None),
        ("from eagleray.serve.engine.engine import LLMEngine", "datagen/x.py", "import the public API"),
        ("from eagleray.serve.engine.engine import LLMEngine", "serve/engine/x.py", None),
        ("from eagleray.serve import hotswap", "datagen/x.py", "layer datagen may import only"),
        ("import eagleray.serve.engine", "training/x.py", "layer training may import only"),
        ("SPEC = 'eagleray.jobs.bench.spec'", "jobs/x.py", "layer jobs may import only"),
        ("from eagleray.jobs.bench import spec", "jobs/cli_x.py", "layer jobs may import only"),
        ("from eagleray.tests.support.tiny import make_tiny_llama", "jobs/bench/x.py", None),
        ("from eagleray.tests.support.tiny import make_tiny_llama", "platform/x.py", "layer platform may import only"),
        ("from eagleray.platform.registry import resolve_draft", "kernels/x.py", "layer kernels may import only nothing"),
    ],
)
def test_import_rules_catch(tmp_path, monkeypatch, code, rel, want):
    """The checker itself: a fake module at ``rel`` with one import is judged by the rules above."""
    fake = REPO / rel
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: code if self == fake else Path.read_bytes(self).decode())
    bad = import_violations([fake])
    assert (not bad) if want is None else (bad and want in bad[0]), bad


ENGINE_NAMES = {"engine", "eng", "llm"}  # how code outside serve/engine/ names an LLMEngine (a variable or self.engine)
ENGINE_PARTS = {"target", "drafts", "scheduler", "blocks", "spec", "watchdog"}  # its internals


def engine_reach_ins(paths: list[Path]) -> list[str]:
    """Reads of an engine's internals outside serve/engine/: its parts (target runner, draft slot, scheduler,
    block manager) or a private attribute; callers use LLMEngine's accessors (aux_layer_ids, target_model, ...)."""
    bad = []
    for path in paths:
        if _layer(_dotted(path)) == ENGINE_API:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", None)
            if owner in ENGINE_NAMES and (node.attr in ENGINE_PARTS or node.attr.startswith("_")):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return bad


def test_no_reads_of_engine_internals():
    bad = engine_reach_ins(_modules())
    assert not bad, "outside serve/engine/ use LLMEngine's public accessors:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "code, want",
    [
        ("engine.target.model.set_aux_layers([1])", "engine.target"),
        ("self.engine.scheduler._preempt(seq)", "self.engine.scheduler"),
        ("x = engine._pending_rollback", "engine._pending_rollback"),
        ("engine.set_aux_layers([1]); engine.aux_layer_ids; engine.target_model", None),
    ],
)
def test_engine_reach_ins_catch(monkeypatch, code, want):
    fake = REPO / "serve" / "x.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: code if self == fake else Path.read_bytes(self).decode())
    bad = engine_reach_ins([fake])
    assert (not bad) if want is None else (bad and want in bad[0]), bad


def test_jobs_holds_entry_points_only():
    """jobs/: one module per command of the CLI (plus the CLI and what entry points share); measurement lives in jobs/bench/."""
    from eagleray.jobs.cli import COMMANDS

    commands = {module for module, _ in COMMANDS.values()}
    found = {_dotted(p) for p in (REPO / "jobs").glob("*.py")} | {"jobs.bench"}
    assert found == {m.removeprefix("eagleray.") for m in commands} | {"jobs.cli", "jobs.entry"}, found


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_ruff_check():
    """Lint (rules in pyproject.toml [tool.ruff]); `ruff` is pinned in requirements.txt."""
    out = _ruff("check", ".")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_format_check():
    """The tree is as `ruff format` writes it (run `ruff format .` before committing)."""
    out = _ruff("format", "--check", ".")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_wheel_contains_every_module(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
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


def undocumented_modules(doc: str, paths: list[Path]) -> list[str]:
    """Modules whose name docs/architecture.md does not mention (a bench module as ``_train`` counts for
    ``draft_scaling_train``: the page names a family's members by their suffix)."""
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", doc))
    missing = []
    for p in paths:
        stem = p.stem
        if stem in ("__init__", "__main__") or stem in words:
            continue
        if any(stem.endswith(w) and w.startswith("_") and stem.removesuffix(w) in words for w in words):
            continue
        missing.append(str(p.relative_to(REPO)))
    return missing


def test_architecture_page_names_every_module():
    """docs/architecture.md describes the tree that is there: every product module and test-support module is named."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    paths = _modules(TOP + ["tests/support"])
    missing = undocumented_modules(doc, paths)
    assert not missing, f"name these modules (what each holds) in docs/architecture.md: {missing}"


def test_architecture_page_check_catches_a_new_module():
    paths = [REPO / "serve" / "engine" / "brand_new_part.py", REPO / "jobs" / "bench" / "draft_scaling_train.py"]
    assert undocumented_modules("`draft_scaling` (+ `_train`)", paths) == ["serve/engine/brand_new_part.py"]
