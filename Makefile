# `make train` and `make test` set everything up on first use (a .venv beside this file).
PYTHON ?= python3
# A second environment beside the first, e.g. `make test PYTHON=python3.12 VENV=.venv312` (.ci/run).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: train test bench gpu-bench gpu-compiler gpu-wheels clean-venv

$(VENV)/.base: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# The XLA GPU compiler as a JAX plugin, with cuDNN (for its fused attention), for compiling for
# GPUs on a machine without one (`lm.layout --target=h100`, tests/test_gpu_compile.py): about
# 2.3 GB. Kept apart from the environment's packages so that CPU runs never load it;
# MESHLM_GPU_COMPILER=1 puts it on the path (lm/__init__.py).
$(VENV)/gpu-compiler/.done: $(VENV)/.base
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/gpu-compiler \
	  "jax-cuda12-plugin==$$($(PY) -c 'import jax; print(jax.__version__)')" \
	  "jax-cuda12-pjrt==$$($(PY) -c 'import jax; print(jax.__version__)')" \
	  nvidia-cudnn-cu12==9.28.0.42 nvidia-cublas-cu12==12.9.3.13 nvidia-cuda-nvrtc-cu12==12.9.86 \
	  || echo "note: the GPU compiler plugin could not be installed; GPU compile checks will be skipped"
	mkdir -p $(@D) && touch $@

gpu-compiler: $(VENV)/gpu-compiler/.done

train: $(VENV)/.base
	$(PY) -m lm.train --config=configs/tiny.py --workdir=runs/tiny

# Two pytest workers, each taking whole test files (their module fixtures are computed once):
# the suite compiles far more than it runs, and one process leaves a core idle between compiles
# (20.5 -> 14.1 min on 2 cores, PERFORMANCE.md). TEST_WORKERS=0 runs it in one process.
# TEST_ARGS: more pytest arguments, e.g. TEST_ARGS='-m "not slow"' (what .ci/run's second stack runs).
TEST_WORKERS ?= 2
TEST_ARGS ?=
test: $(VENV)/.test $(VENV)/gpu-compiler/.done
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(TEST_ARGS)

bench: $(VENV)/.base
	$(PY) -m lm.bench --config=configs/tiny.py

# On a machine with an NVIDIA GPU (after `pip install -e '.[gpu]'`): the GPU run kit, as JSON.
gpu-bench: $(VENV)/.base
	$(PY) benchmarks/gpu.py

# For a GPU host that cannot reach a package index but has JAX with CUDA, flax, optax and orbax
# (a lent GPU machine: Python 3.12): the wheels `benchmarks/gpu.py` and `lm.bench` need beyond
# those, for that Python, in .whl/ (about 6 MB). There: pip install --no-index --find-links .whl
# ml-collections grain tqdm, then python benchmarks/gpu.py.
GPU_PYTHON ?= 3.12
gpu-wheels: $(VENV)/.base
	$(PY) -m pip download -q -d .whl --only-binary=:all: --python-version $(GPU_PYTHON) \
	  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 ml-collections grain tqdm
	rm -f .whl/numpy-*.whl  # the host's own numpy stays

clean-venv:
	rm -rf $(VENV)
