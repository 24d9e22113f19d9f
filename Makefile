# Every target uses the project's own virtual environment at .venv/ and installs it first if needed.
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install test demo bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first and exactly: the CPU wheel on disk, never a CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	$(VENV)/bin/pip check
	touch $(STAMP)

test: install
	$(VENV)/bin/python -m pytest -q tests

demo: install
	$(VENV)/bin/python -m harness_recipes.demo

clean:
	rm -rf $(VENV) *.egg-info
