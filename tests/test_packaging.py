"""What the package says about itself holds: its version, license, typing marker, the
Python and torch it needs, and what ``import autopar`` loads."""

import enum
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import autopar
from autopar.cli import main

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_pyprojects_as_installed():
    installed = importlib.metadata.version("autopar")
    assert autopar.__version__ == installed
    assert installed == PYPROJECT["project"]["version"], "stale metadata: reinstall with pip install -e ."


def test_version_option_prints_it(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out.strip() == f"autopar {autopar.__version__}"


def test_console_script_prints_the_version():
    script = shutil.which("autopar", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the autopar console script is not installed next to this Python")
    out = subprocess.run([script, "--version"], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip() == f"autopar {autopar.__version__}"


def test_python_dash_m_runs_the_same_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "autopar", "--version"], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == f"autopar {autopar.__version__}"
    refused = subprocess.run([sys.executable, "-m", "autopar", "plan"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr


def test_license_file_is_the_license_the_metadata_names():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert " ".join(text.split()[:5]) == "Apache License Version 2.0, January"
    assert "END OF TERMS AND CONDITIONS" in text
    assert importlib.metadata.metadata("autopar")["License-Expression"] == "Apache-2.0"


def test_typed_marker_ships_in_the_package():
    assert (Path(autopar.__file__).parent / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["autopar"]


def test_import_autopar_loads_no_library_only_some_features_need():
    code = (
        "import sys, autopar; print(sorted(m for m in ('networkx', 'matplotlib', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_requires_python_is_the_first_python_with_what_the_code_uses():
    oldest = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"]).groups())
    # enum.StrEnum, the base of autopar's vocabulary (DType, Schedule, ...), is new in 3.11
    assert oldest == (3, 11) and issubclass(autopar.DType, enum.StrEnum)
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"


def test_torch_lower_bound_is_the_release_ci_tests():
    tested = re.search(r"torch==(\d+\.\d+)", (ROOT / ".ci" / "run").read_text()).group(1)
    (torch_requirement,) = [d for d in PYPROJECT["project"]["dependencies"] if re.match(r"torch\b", d)]
    assert f">={tested}" in torch_requirement


def test_user_extras_hold_no_test_tools_and_all_holds_everything():
    extras = PYPROJECT["project"]["optional-dependencies"]
    tools = ("pytest", "hypothesis", "ruff")
    assert not any(dep.startswith(tools) for name in ("hf", "notebooks", "interop", "fp8") for dep in extras[name])
    assert any(dep.startswith("pytest") for dep in extras["test"])
    assert extras["all"] == ["autopar[hf,notebooks,interop,fp8,test,dev]"]  # what .ci/run and the README install
