"""The layout of the code holds: no import circles (every import counted, those inside functions
too), each folder imports only the folders below it, commands import no command; runtime data
ships inside the package, which a non-editable install can use from any directory."""

import os
import subprocess
import sys
import zipfile

import import_graph
import pytest
from conftest import ROOT


def test_no_import_circles_and_no_upward_imports():
    g = import_graph.graph()
    assert len(g) > 60 and g["lm.train"] >= {"lm.training.loop"}  # the walker reads real imports
    assert import_graph.circles(g) == []
    assert import_graph.upward(g) == []


def test_the_detectors_fail_on_a_circle_an_upward_import_and_a_command_importing_a_command():
    g = import_graph.graph()
    circled = {**g, "lm.model.config": g["lm.model.config"] | {"lm.model.transformer"}}
    assert ["lm.model.config", "lm.model.transformer"] in [[m for m in c if m in ("lm.model.config", "lm.model.transformer")] for c in import_graph.circles(circled)]
    assert import_graph.upward({**g, "lm.data.corpus": g["lm.data.corpus"] | {"lm.program.steps"}}) == ["lm.data.corpus -> lm.program.steps"]
    assert import_graph.upward({**g, "lm.train": g["lm.train"] | {"lm.convert"}}) == ["lm.train -> lm.convert"]
    with pytest.raises(KeyError, match="on no floor"):
        import_graph.floor("lm.newfolder.module")


def test_every_command_is_a_door_with_main():
    for name in import_graph.COMMANDS:
        source = (ROOT / "lm" / f"{name}.py").read_text()
        assert "def main(argv" in source and 'if __name__ == "__main__":' in source, name


def test_a_non_editable_install_plans_for_a_target_from_another_directory(tmp_path):
    """The wheel `pip install .` builds, installed apart from the checkout and run from another
    directory: every subpackage and the package data (target descriptions, systems, the
    planner's constants) are in it and found through `lm.hardware.data_file`."""
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheel"), str(ROOT)],
                           capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    (built,) = (tmp_path / "wheel").glob("meshlm-*.whl")
    names = set(zipfile.ZipFile(built).namelist())
    assert {"lm/hardware/h100_sxm.txtpb", "lm/hardware/systems.json", "lm/hardware/calibration.json", "lm/model/transformer.py",
            "sharding/mesh.py"} <= names
    assert not any(n.startswith(("tests/", "configs/", "benchmarks/")) for n in names)
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(built)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    recipe = tmp_path / "recipe.py"
    recipe.write_text((ROOT / "configs" / "llama_1b.py").read_text())
    env = {**{k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "MESHLM_GPU_COMPILER")}, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import lm.hardware; print(lm.hardware.data_file('systems.json'))"],
                           capture_output=True, text=True, cwd=tmp_path, env=env)
    assert where.stdout.startswith(str(site)), where  # the installed copy, not the checkout's
    result = subprocess.run([sys.executable, "-m", "lm.plan", f"--config={recipe}", "--gpus=8", "--target=h100", "--top=2"],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tokens/s" in result.stdout and result.stdout.strip().splitlines()[-1].startswith("{")
