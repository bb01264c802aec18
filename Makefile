# Two commands do everything on a fresh offline machine: `make demo` and `make test`.
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
STAMP   := $(VENV)/.installed-stamp
TRITON_STAMP := $(VENV)/.triton-stamp
PROMPT  ?= To be, or not to be

.PHONY: demo test lint install clean

$(PY):
	python3 -m venv $(VENV)

# torch first: the CPU wheel on local disk, so that nothing pulls a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e ".[dev]"
	touch $(STAMP)

# triton (~1 GB installed) only where its kernels' interpreter tests run: `make test`, hence CI
$(TRITON_STAMP): $(STAMP)
	$(PIP) install -e ".[dev,triton]"
	$(PY) -c "import triton.language"
	touch $(TRITON_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/strata generate --prompt "$(PROMPT)" --max-tokens 48 --temperature 0.8 --seed 0
	$(VENV)/bin/strata bench latency --input-len 64 --output-len 64 --compare hf

lint: $(STAMP)
	$(VENV)/bin/ruff check strata tests
	$(VENV)/bin/lint-imports

test: $(STAMP) $(TRITON_STAMP) lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) *.egg-info
