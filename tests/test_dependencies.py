"""The test suite runs wherever its extra installs: every module it imports is declared."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Dict, Iterable, Set

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

from importlib import metadata  # noqa: E402

REPOSITORY = Path(__file__).resolve().parent.parent


def normalised(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def unconditional(requirements: Iterable[str]) -> Set[str]:
    """The names of the requirements that hold everywhere: no environment marker, no extra."""
    names = set()
    for requirement in requirements:
        if ";" not in requirement:
            names.add(normalised(re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group()))
    return names


def installed_for_sure(roots: Set[str]) -> Set[str]:
    """``roots`` and everything they require unconditionally, as far as it is installed here."""
    seen: Set[str] = set()
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            pending.extend(unconditional(metadata.requires(name) or ()))
        except metadata.PackageNotFoundError:
            continue
    return seen


def imported_modules(paths: Iterable[Path]) -> Dict[str, Set[str]]:
    """Every top-level module imported by ``paths`` (in any function too), with the files that import it."""
    modules: Dict[str, Set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                modules.setdefault(name.partition(".")[0], set()).add(path.name)
    return modules


def test_every_third_party_module_the_tests_import_comes_with_the_test_extra():
    """A module that only a conditional requirement brings (schemathesis, Python 3.11+) fails elsewhere."""
    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]
    declared = unconditional(project["dependencies"]) | unconditional(project["optional-dependencies"]["test"])
    certain = installed_for_sure(declared)
    test_files = sorted((REPOSITORY / "tests").glob("*.py"))
    own = {path.stem for path in test_files} | {"pdiffcopy"}
    distributions = metadata.packages_distributions()
    undeclared = {}
    for module, importers in imported_modules(test_files).items():
        if module in own or module in sys.stdlib_module_names:
            continue
        providers = {normalised(name) for name in distributions.get(module, ())}
        if not providers & certain:
            undeclared[module] = sorted(importers)
    assert undeclared == {}, ("imported by tests/ but not brought by the test extra or the dependencies "
                              f"on every Python: {undeclared}")
