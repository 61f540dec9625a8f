"""The import rules of docs/design.md, enforced by parsing every module's imports.

Between the top-level folders:

| folder     | may import                                                        |
| ext/       | numpy, ml_dtypes, safetensors, tokenizers, jinja2 (+ stdlib)      |
| scheduler/ | numpy, ext (+ stdlib, minus sockets, threads and clocks)          |
| telemetry/ | prometheus_client, structlog (+ stdlib)                           |
| daemon/    | everything                                                        |

Between the rooms inside a folder (an arrow may only run downward):

| room               | may import of its own folder                                |
| daemon/commands/   | service, engine, tuning, store, machine                     |
| daemon/service/    | service, api, engine, workers, tuning, store, machine       |
| daemon/api/        | api, engine                                                 |
| daemon/engine/     | engine, store                                               |
| daemon/workers/    | workers                                                     |
| daemon/tuning/     | tuning, store, machine                                      |
| daemon/store/      | store                                                       |
| daemon/machine/    | machine                                                     |
| ext/ (top level)   | every room                                                  |
| ext/makemodel/     | makemodel (it shares no code with the reader it tests)      |
| ext/quant/         | quant, models, formats (never kernels: the codecs are numpy) |
| ext/models/        | models, formats, kernels                                    |
| ext/formats/       | formats                                                     |
| ext/kernels/       | kernels                                                     |

and only daemon/service/ and daemon/commands/ may import aiohttp (the HTTP side). Every
module of daemon/ lives in a room: daemon/ itself holds only __init__.py.
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
# Rooms of a folder, and the rooms of the same folder each may import ("" = the folder's
# top-level modules).
ROOMS = {
    "daemon": {"commands": {"commands", "service", "engine", "tuning", "store", "machine"},
               "service": {"service", "api", "engine", "workers", "tuning", "store", "machine"},
               "api": {"api", "engine"},
               "engine": {"engine", "store"},
               "workers": {"workers"},
               "tuning": {"tuning", "store", "machine"},
               "store": {"store"},
               "machine": {"machine"}},
    "ext": {"": {"", "quant", "models", "formats", "kernels", "makemodel"},
            "makemodel": {"makemodel"},
            "quant": {"quant", "models", "formats"},
            "models": {"models", "formats", "kernels"},
            "formats": {"formats"},
            "kernels": {"kernels"}},
}
HTTP_ROOMS = {"service", "commands"}       # the daemon's rooms that may import aiohttp


def _sources(package: str) -> list[Path]:
    folder = ROOT / package
    return sorted(folder.rglob("*.py")) + sorted(folder.rglob("*.pyx"))


def _module_of(path: Path) -> list[str]:
    """The dotted package of `path` (its folder), as a list of names from ROOT."""
    return list(path.relative_to(ROOT).parent.parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, full dotted module) of each import; relative imports are resolved."""
    text = path.read_text(encoding="utf-8")
    here = _module_of(path)
    if path.suffix == ".pyx":  # Cython: check the plain `import` / `from ... import` lines
        found = []
        for i, line in enumerate(text.splitlines(), 1):
            words = line.split()
            if len(words) >= 2 and words[0] in ("import", "cimport", "from") and not line.startswith(" "):
                name = words[1]
                if name.startswith("."):
                    level = len(name) - len(name.lstrip("."))
                    name = ".".join(here[:len(here) - level + 1] + [name.lstrip(".")]).rstrip(".")
                found.append((i, name))
        return found
    found = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            # `from daemon import store` names the room store, not the package daemon
            if name in ROOMS:
                found += [(node.lineno, f"{name}.{a.name}") for a in node.names
                          if a.name in ROOMS[name]]
    return found


def _room(package: str, parts: list[str]) -> str | None:
    """The room of a module path (its parts after the package), "" for the top level."""
    if len(parts) >= 1 and parts[0] in ROOMS[package]:
        return parts[0]
    return "" if "" in ROOMS[package] else None


def _violations(package: str) -> list[str]:
    bad = []
    for path in _sources(package):
        own = path.relative_to(ROOT / package).parts      # e.g. ("store", "reads.py")
        room = _room(package, list(own[:-1])) if package in ROOMS else None
        if package == "daemon" and len(own) == 1 and own[0] != "__init__.py":
            bad.append(f"{path.relative_to(ROOT)}: every module of daemon/ belongs in a room")
        for line, module in _imports(path):
            rel = f"{path.relative_to(ROOT)}:{line}"
            top = module.split(".")[0]
            if package in ROOMS and top == package:
                target = _room(package, module.split(".")[1:])
                if target is not None and room is not None and target not in ROOMS[package][room]:
                    bad.append(f"{rel}: {package}/{room or '(top level)'} may not import "
                               f"{package}/{target or '(top level)'} ({module})")
            if package == "daemon":
                if top == "aiohttp" and room not in HTTP_ROOMS:
                    bad.append(f"{rel}: daemon/{room} may not import aiohttp (the HTTP side is "
                               "daemon/service and daemon/commands)")
                continue
            if package == "scheduler" and top in SCHEDULER_FORBIDDEN_STDLIB:
                bad.append(f"{rel}: scheduler/ may not import {top}")
            elif top in STDLIB or top in ("__future__", "cython", "libc", "cpython", "openmp"):
                continue
            elif top not in ALLOWED[package]:
                bad.append(f"{rel}: {package}/ may not import {top}")
    return bad


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_folder_rules(package):
    assert (ROOT / package / "__init__.py").exists()
    assert _violations(package) == []


@pytest.mark.parametrize("package", sorted(ROOMS))
def test_every_room_says_what_it_owns(package):
    """Each room's __init__.py has a docstring (what the room owns, what it may import)."""
    for room in ROOMS[package]:
        init = ROOT / package / room / "__init__.py"
        assert init.exists(), f"{package}/{room} is not a package"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc.lower(), f"{init.relative_to(ROOT)} must say what it may import"


def _tree(tmp_path: Path, files: dict[str, str]) -> None:
    for name, body in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
        for parent in path.relative_to(tmp_path).parents:
            if parent != Path("."):
                (tmp_path / parent / "__init__.py").touch()


def test_checker_catches_a_forbidden_arrow(tmp_path, monkeypatch):
    """The checker itself: ext/ importing daemon/ and scheduler/ reading the clock fail."""
    _tree(tmp_path, {"ext/bad.py": "import daemon.commands.cli\nfrom telemetry import x\n",
                     "scheduler/bad.py": "import time\nimport numpy\n",
                     "telemetry/bad.py": "import aiohttp\n",
                     "daemon/commands/ok.py": "import torch\nimport aiohttp\n"})
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert len(_violations("ext")) == 2
    assert _violations("scheduler") == ["scheduler/bad.py:1: scheduler/ may not import time"]
    assert len(_violations("telemetry")) == 1
    assert _violations("daemon") == []


def test_checker_catches_an_arrow_that_runs_up_between_rooms(tmp_path, monkeypatch):
    """An arrow up (store -> service, tuning -> service, service -> commands, formats ->
    models, kernels -> formats), aiohttp outside the HTTP rooms and a module outside any
    room are each refused; downward arrows, relative or absolute, pass."""
    _tree(tmp_path, {
        "daemon/store/a.py": "from daemon.service import app\nfrom daemon.store import b\n",
        "daemon/store/b.py": "import aiohttp\n",
        "daemon/tuning/c.py": "from daemon.engine.engine import Engine\nfrom ..store import a\n",
        "daemon/service/d.py": "import daemon.commands.cli\nfrom daemon.tuning import c\n",
        "daemon/machine/e.py": "from daemon import store\n",
        "daemon/commands/f.py": "from daemon.service import d\nfrom daemon.machine import e\n",
        "daemon/loose.py": "",
        "ext/formats/g.py": "from ext.models import model\nfrom .h import x\n",
        "ext/formats/h.py": "",
        "ext/kernels/k.pyx": "from ext.formats import g\nimport numpy\n",
        "ext/models/m.py": "from ext.kernels import k\nfrom ..formats import g\nfrom ext.tokenizer import T\n",
        "ext/tokenizer.py": "from ext.models import m\n",
    })
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    daemon = _violations("daemon")
    assert sorted(v.split(":")[0] + ":" + v.split(":")[1] for v in daemon) == [
        "daemon/loose.py: every module of daemon/ belongs in a room",
        "daemon/machine/e.py:1", "daemon/service/d.py:1", "daemon/store/a.py:1",
        "daemon/store/b.py:1", "daemon/tuning/c.py:1"]
    ext = _violations("ext")
    assert sorted(v.split(":")[0] for v in ext) == [
        "ext/formats/g.py", "ext/kernels/k.pyx", "ext/models/m.py"]
    assert "ext/models may not import ext/(top level)" in next(v for v in ext if "m.py" in v)
