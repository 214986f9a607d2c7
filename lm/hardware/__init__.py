"""The GPUs meshlm plans and compiles for, as data shipped inside the package: their compiler
descriptions (`*.txtpb`, `lm.compiler.targets`), links and memory bandwidth (`systems.json`,
`lm.hardware.systems`), dense peaks (`lm.hardware.peaks`), the planner's fitted constants
(`calibration.json`, written by `lm.calibrate`) and the published runs it is held to
(`published.json`). `data_file` is the one way in: an installed meshlm finds them as a checkout
does."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def data_file(name: str) -> Path:
    """The path of one of this folder's data files."""
    return Path(str(resources.files(__name__).joinpath(name)))
