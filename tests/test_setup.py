"""Set-up never depends on the day: README's commands, CI and constraints.txt agree."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement line (PEP 503)."""
    name = re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _pinned() -> dict[str, list[str]]:
    pins: dict[str, list[str]] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert "==" in line, f"constraints.txt pins exact versions; found {line!r}"
            pins.setdefault(_name(line), []).append(line.strip())
    return pins


def test_readme_commands_use_the_constraints_and_ci_runs_the_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^pip install -e \"\.\[(\w+)\]\"(.*?)&& (.+)$", readme, re.M)
    by_extra = {extra: (rest.strip(), run.strip()) for extra, rest, run in commands}
    assert set(by_extra) >= {"examples", "test"}, commands
    for extra, (rest, _) in by_extra.items():
        assert rest == "-c constraints.txt", f"README installs [{extra}] without the constraints"
    test_command = f'pip install -e ".[test]" -c constraints.txt && {by_extra["test"][1]}'
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines(), f"{test_command!r} is not a line of .ci/run"


def test_constraints_pin_every_dependency_of_every_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pinned()
    wanted = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted += extra
    missing = sorted({_name(r) for r in wanted} - set(pins))
    assert not missing, (
        f"constraints.txt does not pin {missing}: refresh it as README.md says "
        "(uv pip compile pyproject.toml --all-extras --universal -o constraints.txt)"
    )


def test_runtime_dependencies_stay_ranges():
    # users install loopkit beside their own pins: no exact versions in the runtime set
    for requirement in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "dependencies"]:
        assert "==" not in requirement, requirement
