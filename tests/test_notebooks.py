"""The notebooks: each one has the parameter contract of STYLE.md rule 8, is committed stripped, and runs
to the end in smoke mode with papermill (cwd notebooks/, figures into a temporary folder).

Smoke runs take ~10-15 s each on 2 cores (a kernel start, the torch import, small sizes), each into its
own temporary folder; one test per notebook, so a failure names its notebook. Notebook 01's toy training is
precomputed (data/notebooks/): two tests check its rows and that the notebook reads them instead of training.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

# `make test` installs the notebooks extra, so CI always runs these; a bare GPU machine without
# jupyter skips this file with the reason instead of failing the whole collection.
nbformat = pytest.importorskip("nbformat", reason="needs mok[notebooks] (nbformat, papermill)")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
EXPECTED = ["01_routing", "02_mxfp8_quantization", "03_fused_communication", "04_end_to_end"]
# STYLE.md rule 8: the same contract in every notebook (annotation -> type of the literal).
CONTRACT = {"smoke": "bool", "device": "str", "seed": "int", "level": "str", "source": "str", "out_dir": "str"}
LITERAL_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
IDS = [p.stem for p in NOTEBOOKS]


def test_the_four_notebooks_exist():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


def parameters_cell(nb) -> nbformat.NotebookNode:
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged 'parameters', found {len(cells)}"
    assert cells[0].cell_type == "code"
    return cells[0]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_parameter_contract(path):
    nb = nbformat.read(path, as_version=4)
    tree = ast.parse(parameters_cell(nb).source)
    params = {}
    for stmt in tree.body:
        assert isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name), (
            f"{path.name}: the parameters cell holds annotated assignments only, got {ast.dump(stmt)[:80]}")
        assert isinstance(stmt.annotation, ast.Name) and stmt.annotation.id in LITERAL_TYPES, (
            f"{path.name}: {stmt.target.id} must be annotated bool/int/float/str")
        assert isinstance(stmt.value, ast.Constant), f"{path.name}: {stmt.target.id} must be a literal"
        value = stmt.value.value
        assert type(value) is LITERAL_TYPES[stmt.annotation.id] or (
            stmt.annotation.id == "float" and type(value) is int), f"{path.name}: {stmt.target.id} = {value!r}"
        params[stmt.target.id] = (stmt.annotation.id, value)
    for name, kind in CONTRACT.items():
        assert name in params and params[name][0] == kind, f"{path.name}: missing `{name}: {kind}`"
    assert params["smoke"][1] is False and params["source"][1] in ("precomputed", "live")
    # every notebook steps down the ladder from L1 ("torch", which runs on the CPU) against L0 by default
    assert params["level"][1] == "torch" and params["device"][1] == "cpu"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_committed_stripped(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "), "a title first"
    assert "You will learn" in nb.cells[0].source
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: outputs not stripped"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_runs_in_smoke_mode(path, tmp_path):
    import papermill  # same extra as nbformat: missing here is a broken install, not a skip
    out_dir = tmp_path / "figures"
    papermill.execute_notebook(str(path), str(tmp_path / path.name), kernel_name="python3", cwd=str(path.parent),
                               parameters={"smoke": True, "out_dir": str(out_dir)}, progress_bar=False)
    figures = sorted(p.name for p in out_dir.glob("*.png"))
    prefix = path.stem[:2]
    assert len(figures) >= 3 and all(f.startswith(prefix + "_") for f in figures), figures
    # a smoke figure is marked in its name, so it never overwrites the full one in the same out_dir
    assert all(f.endswith("_smoke.png") for f in figures), figures
    assert all((out_dir / f).stat().st_size > 10_000 for f in figures), "a PNG with content"


# --- precomputed rows (data/notebooks/, notebooks/precompute.py) ---------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent
ROUNDING_CSV = ROOT / "data" / "notebooks" / "01_rounding_training.csv"
PROVENANCE = ["torch", "commit", "date", "seed", "toy_seeds", "toy_steps", "wall_s", "command"]


def parameter_defaults(path) -> dict:
    tree = ast.parse(parameters_cell(nbformat.read(path, as_version=4)).source)
    return {stmt.target.id: stmt.value.value for stmt in tree.body}


def test_rounding_training_rows_match_notebook_01():
    """The CSV notebook 01 reads by default exists, carries its provenance, and was taken at the notebook's
    default sizes; the notebook reads it and says in prose how to regenerate it."""
    import pandas as pd
    df = pd.read_csv(ROUNDING_CSV)
    assert set(PROVENANCE) <= set(df.columns), f"provenance columns missing: {set(PROVENANCE) - set(df.columns)}"
    assert df[PROVENANCE].notna().all().all() and df["command"].str.startswith("make notebook-data").all()
    defaults = parameter_defaults(ROOT / "notebooks" / "01_routing.ipynb")
    taken = df[["seed", "toy_seeds", "toy_steps"]].drop_duplicates().values.tolist()
    assert taken == [[defaults["seed"], defaults["toy_seeds"], defaults["toy_steps"]]]
    # every (student, arm) reaches the last step: 2 arms × toy_seeds students
    assert len(df[df.step == defaults["toy_steps"]]) == 2 * defaults["toy_seeds"]
    nb = nbformat.read(ROOT / "notebooks" / "01_routing.ipynb", as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    prose = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "precompute.read_rounding_training(" in code
    assert ROUNDING_CSV.name in prose and "make notebook-data" in prose, "the regenerate command beside the rows"


def test_notebook_01_precomputed_does_not_train(tmp_path):
    """With source="precomputed" notebook 01 reads the toy's rows and never trains: run it (smoke sizes) against
    a copy of its helpers whose training function raises."""
    import papermill
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    for helper in (ROOT / "notebooks").glob("*.py"):
        text = helper.read_text()
        if helper.name == "precompute.py":
            marker = "def rounding_training(seed: int, seeds: int, steps: int) -> pd.DataFrame:\n"
            assert marker in text
            text = text.replace(marker, marker + '    raise AssertionError("trained with source=precomputed")\n')
        (nbdir / helper.name).write_text(text)
    (tmp_path / "data").symlink_to(ROOT / "data")  # precompute.py finds data/ beside notebooks/
    out_dir = tmp_path / "figures"
    papermill.execute_notebook(str(ROOT / "notebooks" / "01_routing.ipynb"), str(tmp_path / "01.ipynb"),
                               kernel_name="python3", cwd=str(nbdir), progress_bar=False,
                               parameters={"smoke": True, "source": "precomputed", "out_dir": str(out_dir)})
    assert (out_dir / "01_rounding_training_smoke.png").stat().st_size > 10_000
