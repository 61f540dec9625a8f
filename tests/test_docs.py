"""The documentation: docs/ builds with mkdocs in strict mode, and the pages name what the
code has (every configuration key, metric family, make-model architecture, command and
Debian package of the test run), so docs cannot go stale without a failing test."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from daemon.commands.cli import COMMANDS, build_parser, command_parser
from daemon.service.config import KEYS, ServeConfig, default_text
from ext.makemodel import ARCHITECTURES
from telemetry.metrics import DaemonMetrics

import tools  # tests/tools.py: conftest.py puts tests/ on sys.path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def test_mkdocs_builds_strict_without_warnings(tmp_path):
    # Not --quiet: it hides the warnings from the count that --strict aborts on.
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                             "--config-file", str(ROOT / "mkdocs.yml"),
                             "--site-dir", str(tmp_path / "site")],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stdout + result.stderr, result.stderr
    assert (tmp_path / "site" / "configuration.html").is_file()


def test_nav_lists_every_page():
    nav = re.findall(r"^\s+- [^:]+: (\S+\.md)$", _read("mkdocs.yml"), re.M)
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages


def test_configuration_page_names_every_key():
    page = _read("docs/configuration.md")
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", page, re.M))
    assert rows == set(KEYS), (sorted(set(KEYS) - rows), sorted(rows - set(KEYS)))
    for key, spec in KEYS.items():
        row = re.search(rf"^\| `{key}` \|.*$", page, re.M).group(0)
        assert f"`MOED_{key.upper()}`" in row and f"`--{key.replace('_', '-')}`" in row, key
        assert spec.help in row, key            # the words of `moed serve --help`
        default = row.split(" | ")[3].strip("`")
        assert default == default_text(key), key   # the default as --help shows it (512M)
    numerics = re.search(r"^\| `numerics` \|.*$", page, re.M).group(0)
    assert f"| `{ServeConfig().numerics}` |" in numerics and "auto (" in numerics


def test_make_model_reference_lists_every_architecture():
    page = _read("docs/cli.md")
    listed = re.search(r"`moed make-model --arch \{([a-z0-9_,]+)\}", page)
    assert listed, "docs/cli.md has no make-model synopsis"
    assert tuple(listed.group(1).split(",")) == ARCHITECTURES


def test_readme_table_and_cli_reference_name_every_command():
    readme, cli = _read("README.md"), _read("docs/cli.md")
    table = re.findall(r"^\| \[`moed ([a-z-]+)`\]\(docs/cli\.md#moed-([a-z-]+)\) \| (.+) \|$",
                       readme, re.M)
    # the table is `moed --help`'s list: every command, in its order, with its line
    assert [(name, text) for name, _, text in table] == [(c.name, c.help) for c in COMMANDS]
    headings = set(re.findall(r"^## moed ([a-z-]+)$", cli, re.M))
    for name, anchor, _ in table:
        assert anchor == name and name in headings, name


def test_cli_reference_names_every_option_of_every_command():
    # --help and --log-level are the page's opening words for every command
    sections = dict(re.findall(r"^## moed ([a-z-]+)\n(.*?)(?=^## |\Z)", _read("docs/cli.md"),
                               re.M | re.S))
    parser = build_parser()
    missing = {}
    for command in COMMANDS:
        options = {option for action in command_parser(parser, command.name)._actions
                   for option in action.option_strings
                   if option.startswith("--") and option not in ("--help", "--log-level")}
        assert options, command.name            # the parser was found and read
        text = sections.get(command.name, "")
        missing[command.name] = sorted(o for o in options
                                       if not re.search(rf"`[^`]*{re.escape(o)}(?![\w-])", text))
    assert not any(missing.values()), {k: v for k, v in missing.items() if v}


def test_readme_keeps_both_commands():
    readme = _read("README.md")
    for marker, command in (("<!-- demo-command -->", ".venv/bin/moed demo"),
                            ("<!-- test-command -->", ".venv/bin/python -m pytest")):
        after = readme.split(marker, 1)[1]
        block = re.match(r"\s*```sh\n(.+?)\n```", after, re.S)
        assert block and command in block.group(1), marker


def test_metrics_page_names_every_family():
    metrics = DaemonMetrics(version="0", model_type="qwen3_moe", moe_layers=[0, 1],
                            read_seconds_buckets=[0.001, float("inf")])
    families = {f.name: f.documentation for f in metrics.registry.collect()
                if not f.name.startswith("process_")}
    assert len(families) > 20
    rows = dict(re.findall(r"^\| `(moed_[a-z_]+)` \| [a-z]+ \| [^|]+ \| (.+) \|$",
                           _read("docs/metrics.md"), re.M))
    documented = {re.sub(r"_(total|info)$", "", name): text.replace("\\|", "|")
                  for name, text in rows.items()}
    assert documented == families           # every family, with its HELP text


def test_testing_page_names_every_package_the_test_run_installs():
    page = _read("docs/testing.md")
    missing = sorted(p for p in set(tools.PACKAGES.values())
                     if not re.search(rf"(?<![\w-]){re.escape(p)}(?![\w-])", page))
    assert not missing
