# Two commands do everything on a fresh offline machine: `make demo` and `make test`.
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
STAMP   := $(VENV)/.installed-stamp
TRITON_STAMP := $(VENV)/.triton-stamp
PROMPT  ?= To be, or not to be

.PHONY: demo test lint install clean browser

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

# headless Chromium for the reports' layout test (tests/analyze/test_report_rendering.py, which skips
# without it): Debian's package, where we are root with apt-get and STRATA_NO_APT is not 1; never fatal
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null \
	  || [ "$$STRATA_NO_APT" = 1 ] || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
	  || DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
	  || (DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null 2>&1 \
	      && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1) \
	  || echo "browser: chromium not installable here; the report layout test will skip"

test: $(STAMP) $(TRITON_STAMP) lint browser
	$(PY) -m pytest

clean:
	rm -rf $(VENV) *.egg-info
