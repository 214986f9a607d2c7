"""`sharding` stands on its own: importing it loads no `lm` module, and its source imports only
jax, flax, numpy, the standard library and itself."""

import ast
import subprocess
import sys
from pathlib import Path

import sharding

ALLOWED = {"jax", "jaxlib", "flax", "numpy", "sharding"}


def test_importing_sharding_loads_no_lm_module():
    code = "import sys, sharding, sharding.distributed; print(sorted(m for m in sys.modules if m == 'lm' or m.startswith('lm.')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
    # The negative control: the same probe sees lm when lm is imported.
    control = subprocess.run([sys.executable, "-c", code.replace("import sys,", "import sys, lm,")], capture_output=True, text=True,
                             env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert "'lm'" in control.stdout


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_sharding_depends_only_on_jax_flax_numpy():
    stdlib = set(sys.stdlib_module_names)
    for path in Path(sharding.__file__).parent.glob("*.py"):
        outside = _top_level_imports(path) - ALLOWED - stdlib - {"__future__"}
        assert not outside, (path.name, outside)
    assert "lm" not in ALLOWED and "lm" not in stdlib  # an `import lm` would be caught above
