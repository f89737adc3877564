# specserve developer entry points. `make test` and `make demo` work on a fresh CPU machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# The CPU build of torch is installed first so that nothing pulls a multi-gigabyte CUDA build.
TORCH_CPU ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: venv test test-gpu demo serve bench proto demo-model clean

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_CPU) || \
		$(PIP) install -q $(TORCH_CPU) --index-url $(TORCH_INDEX)
	$(PIP) install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q -x

test-gpu: venv
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) build *.egg-info
