"""The folder import rules of DESIGN.md, enforced by parsing every module's imports.

| folder     | may import                                                        |
| ext/       | numpy, ml_dtypes, safetensors, tokenizers, jinja2 (+ stdlib)      |
| scheduler/ | numpy, ext (+ stdlib, minus sockets, threads and clocks)          |
| telemetry/ | prometheus_client, structlog (+ stdlib)                           |
| daemon/    | everything                                                        |
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ext", "scheduler", "telemetry", "daemon")
STDLIB = set(sys.stdlib_module_names)
ALLOWED = {
    "ext": {"numpy", "ml_dtypes", "safetensors", "tokenizers", "jinja2", "ext"},
    "scheduler": {"numpy", "ext", "scheduler"},
    "telemetry": {"prometheus_client", "structlog", "telemetry"},
}
# Policy code is pure: no sockets, no threads, no clock reads (time is passed in).
SCHEDULER_FORBIDDEN_STDLIB = {"socket", "threading", "asyncio", "time", "concurrent",
                              "multiprocessing", "selectors", "subprocess"}


def _sources(package: str) -> list[Path]:
    folder = ROOT / package
    return sorted(folder.rglob("*.py")) + sorted(folder.rglob("*.pyx"))


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, top-level module) of each import; relative imports resolve to package."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".pyx":  # Cython: check the plain `import` / `from ... import` lines
        found = []
        for i, line in enumerate(text.splitlines(), 1):
            words = line.split()
            if len(words) >= 2 and words[0] in ("import", "cimport", "from") and not line.startswith(" "):
                name = words[1]
                found.append((i, package if name.startswith(".") else name.split(".")[0]))
        return found
    found = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, package if node.level else (node.module or "").split(".")[0]))
    return found


def _violations(package: str) -> list[str]:
    bad = []
    for path in _sources(package):
        for line, module in _imports(path, package):
            rel = f"{path.relative_to(ROOT)}:{line}"
            if package == "daemon":
                continue
            if package == "scheduler" and module in SCHEDULER_FORBIDDEN_STDLIB:
                bad.append(f"{rel}: scheduler/ may not import {module}")
            elif module in STDLIB or module in ("__future__", "cython", "libc", "cpython", "openmp"):
                continue
            elif module not in ALLOWED[package]:
                bad.append(f"{rel}: {package}/ may not import {module}")
    return bad


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_folder_rules(package):
    assert (ROOT / package / "__init__.py").exists()
    assert _violations(package) == []


def test_checker_catches_a_forbidden_arrow(tmp_path, monkeypatch):
    """The checker itself: ext/ importing daemon/ and scheduler/ reading the clock fail."""
    for pkg, body in (("ext", "import daemon.commands.cli\nfrom telemetry import x\n"),
                      ("scheduler", "import time\nimport numpy\n"),
                      ("telemetry", "import aiohttp\n"), ("daemon", "import torch\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / "bad.py").write_text(body)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert len(_violations("ext")) == 2
    assert _violations("scheduler") == ["scheduler/bad.py:1: scheduler/ may not import time"]
    assert len(_violations("telemetry")) == 1
    assert _violations("daemon") == []
