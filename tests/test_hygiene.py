"""Repository hygiene: what review keeps asking for, checked on every run.

* README.md is a front page: at most 200 lines.
* No tracked file says "s-e-s-s-i-o-n" or its plural, as a word of its own (built from
  pieces below, so that this file does not trip its own check).
* Package code (``autoplace/``, ``envs/``, ``policies/``) names no ``bench/results`` path:
  measurements live with their run, the code cites none.
* Layers import-linter cannot see: ``envs/`` and ``policies/`` are installed as
  ``autoplace.envs`` and ``autoplace.policies`` (setuptools ``package-dir``), so an import of
  ``autoplace.policies`` in ``envs/`` or of either in the library's lower layers is only
  found by reading the modules' import statements.
* Tests share helpers through ``tests/helpers`` only: no test module imports another test
  module or a script (scripts are run as subprocesses), and none edits ``sys.path``.

Each check is a function over text, tested first on a planted violation.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT

README_MAX_LINES = 200
WORD = "ses" + "sion"
WORD_RE = re.compile(rf"\b{WORD}s?\b", re.IGNORECASE)  # the plural too
RESULTS_PATH = "bench" + "/results"
PACKAGE_DIRS = ("autoplace", "envs", "policies")
#: folders installed under another name (pyproject's ``package-dir``)
INSTALLED_AS = {"autoplace": "autoplace", "envs": "autoplace.envs",
                "policies": "autoplace.policies"}
#: the library below the environments and the policies: none of it imports either
LOWER_LAYERS = ("capture", "costs", "sim", "planners", "executor", "zoo", "lowering.py",
                "grouping.py", "graph.py", "plan.py", "plan_validation.py",
                "parallel_config.py", "cluster.py", "cluster_json.py", "device.py",
                "byte_sizes.py", "errors.py", "workloads.py", "files.py")
ENVS, POLICIES = "autoplace.envs", "autoplace.policies"


# ------------------------------------------------------------------ the checks


def word_lines(text: str) -> list[int]:
    """1-based numbers of the lines of ``text`` that hold the forbidden word."""
    return [i for i, line in enumerate(text.splitlines(), 1) if WORD_RE.search(line)]


def results_path_lines(text: str) -> list[int]:
    """1-based numbers of the lines of ``text`` that name a ``bench/results`` path."""
    return [i for i, line in enumerate(text.splitlines(), 1) if RESULTS_PATH in line]


def module_name(path: Path) -> str:
    """The installed dotted name of a module file under the repository root
    (``envs/backends.py`` -> ``autoplace.envs.backends``)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([INSTALLED_AS.get(parts[0], parts[0]), *parts[1:]])


def imported_modules(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """``(line, dotted name)`` of every module ``source`` imports, wherever the statement
    is (function bodies and ``TYPE_CHECKING`` blocks included): ``import x``, ``from x
    import y`` (as ``x.y`` too, ``y`` may be a module), relative imports resolved against
    ``module``, and ``importlib.import_module("x")`` / ``__import__("x")`` with a literal.

    Args:
        source: the module's text.
        module: its installed dotted name (what relative imports are relative to).
        is_package: ``module`` is a package's ``__init__``.
    """
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            yield node.lineno, name
            for alias in node.names:
                yield node.lineno, f"{name}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if called in ("import_module", "__import__") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str):
                yield node.lineno, arg.value


def forbidden_imports(source: str, module: str, forbidden: tuple[str, ...],
                      is_package: bool = False) -> list[tuple[int, str]]:
    """The imports of ``source`` that reach one of the ``forbidden`` packages."""
    return sorted({(line, name) for line, name in imported_modules(source, module, is_package)
                   if any(name == f or name.startswith(f + ".") for f in forbidden)})


def imports_a_test_may_not_make(source: str, module: str, scripts: set[str]) -> list[tuple[int, str]]:
    """The imports of test code ``source`` that reach a test module (``test_*``,
    ``conftest``) or one of the ``scripts`` (module names), and its ``sys.path`` edits."""
    hits = set()
    for line, name in imported_modules(source, module):
        last = name.rsplit(".", 1)[-1]
        if last.startswith("test_") or last == "conftest" or name.split(".")[0] in scripts:
            hits.add((line, name))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "path" \
                and isinstance(node.value, ast.Name) and node.value.id == "sys":
            hits.add((node.lineno, "sys.path"))
    return sorted(hits)


# ------------------------------------------------------------------ the repository


def tracked_files() -> list[Path]:
    """The files git tracks that exist in the working tree."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout: no list of tracked files")
    paths = [ROOT / p for p in out.decode().split("\0") if p]
    return [p for p in paths if p.is_file()]


def read_text(path: Path) -> str | None:
    """The file's text, None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def package_modules(*tops: str) -> list[Path]:
    """Every ``.py`` file under the given folders or files of the repository root."""
    files: list[Path] = []
    for top in tops:
        path = ROOT / top
        assert path.exists(), f"{top} named in a hygiene check does not exist: update the check"
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def _layer_violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in files:
        hits = forbidden_imports(path.read_text(), module_name(path), forbidden,
                                 is_package=path.name == "__init__.py")
        found += [f"{path.relative_to(ROOT)}:{line}: imports {name}" for line, name in hits]
    return found


# ------------------------------------------------------------------ the checks can fail


def test_the_word_check_finds_a_planted_word():
    planted = (f"fine\nthe {WORD.capitalize()}-20 suite\nstart_new_{WORD}=True\n"
               f"{WORD.upper()}S 18-19\n{WORD}al\n")
    assert word_lines(planted) == [2, 4]  # the plural too; not inside another word


def test_the_results_path_check_finds_a_planted_path():
    planted = f'"""Fitted on x.\n\nSee {RESULTS_PATH}/2026-11-27-h200x2-suite/."""\n'
    assert results_path_lines(planted) == [3]


def test_the_import_check_finds_every_form_of_a_planted_import():
    planted = (
        "import autoplace.policies\n"
        "from autoplace.policies.reinforce import train\n"
        "from autoplace import policies\n"
        "def f():\n"
        "    from .. import policies\n"
        "    import importlib\n"
        "    importlib.import_module('autoplace.policies.gnn')\n"
        "from ..policies import gnn\n"
        "from autoplace.planners import policy_free\n"
    )
    hits = forbidden_imports(planted, "autoplace.envs.backends", (POLICIES,))
    assert sorted({line for line, _ in hits}) == [1, 2, 3, 5, 7, 8]
    # an envs module's relative ``..`` is autoplace: ``from .. import policies`` is caught
    assert (5, "autoplace.policies") in hits
    assert forbidden_imports("from . import placement_env\n", "autoplace.envs", (POLICIES,),
                             is_package=True) == []


def test_the_test_import_check_finds_planted_imports():
    planted = (
        "from tests.core.test_grouping_branch import branches\n"
        "import test_sim\n"
        "from . import conftest\n"
        "import bench_plans as bp\n"
        "import sys\n"
        "sys.path.insert(0, 'scripts')\n"
        "from tests.helpers.graphs import branches\n"
        "from autoplace.sim import simulate\n"
    )
    hits = imports_a_test_may_not_make(planted, "tests.envs.test_env_branch", {"bench_plans"})
    assert sorted({line for line, _ in hits}) == [1, 2, 3, 4, 6]


def test_module_names_follow_the_installed_layout():
    assert module_name(ROOT / "envs" / "backends.py") == "autoplace.envs.backends"
    assert module_name(ROOT / "policies" / "__init__.py") == "autoplace.policies"
    assert module_name(ROOT / "autoplace" / "sim" / "step.py") == "autoplace.sim.step"


# ------------------------------------------------------------------ the repository passes


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, at most {README_MAX_LINES}"


def test_no_tracked_file_says_the_word():
    found = []
    for path in tracked_files():
        text = read_text(path)
        if text is not None:
            found += [f"{path.relative_to(ROOT)}:{n}" for n in word_lines(text)]
    assert not found, f"'{WORD}' in tracked files (say what happened, not when):\n" \
        + "\n".join(found)


def test_package_code_names_no_results_path():
    found = [f"{path.relative_to(ROOT)}:{n}" for path in package_modules(*PACKAGE_DIRS)
             for n in results_path_lines(path.read_text())]
    assert not found, (f"{RESULTS_PATH} named in package code (cite runs in docs/, not in "
                       "the code):\n" + "\n".join(found))


def test_the_library_imports_no_environment_or_policy():
    lower = package_modules(*(f"autoplace/{x}" for x in LOWER_LAYERS))
    found = _layer_violations(lower, (ENVS, POLICIES))
    assert not found, "a lower layer imports the environments or the policies:\n" \
        + "\n".join(found)


def test_the_environments_import_no_policy():
    found = _layer_violations(package_modules("envs"), (POLICIES,))
    assert not found, "the environments import the policies:\n" + "\n".join(found)


def test_tests_import_no_test_module_or_script():
    scripts = {p.stem for p in (ROOT / "scripts").rglob("*.py")}
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        hits = imports_a_test_may_not_make(path.read_text(), module_name(path), scripts)
        found += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in hits]
    assert not found, ("tests import a test module or a script, or edit sys.path (shared "
                       "code goes in tests/helpers; scripts run as subprocesses):\n"
                       + "\n".join(found))
