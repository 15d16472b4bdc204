"""Execute a notebook in a fresh kernel and index its outputs by cell tag."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def run_notebook(name: str, tmp_path: Path, timeout_s: int = 600) -> dict[str, list[dict]]:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:
        assert not cell.get("outputs"), f"{name} must be committed without outputs"
    NotebookClient(nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    return {tag: cell.outputs for cell in nb.cells if cell.cell_type == "code"
            for tag in cell.metadata.get("tags", [])}


def text_of(outputs: list[dict]) -> str:
    parts = []
    for out in outputs:
        if out.get("output_type") == "stream":
            parts.append(out["text"])
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
    return "".join(parts)


def has_png(outputs: list[dict]) -> bool:
    return any("image/png" in out.get("data", {}) for out in outputs)


@pytest.fixture()
def notebook_dir(tmp_path):
    return tmp_path
