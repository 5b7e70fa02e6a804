# Two commands: `make demo` and `make test`. Everything else is their plumbing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Bytecode is compiled as modules are first imported, not at install: pip would compile every file of every
# package (half of the set-up's time), while the suite imports a part of them. The suite starts dozens of Python
# processes (servers, engine cores, workers), so the bytecode is written for the next one even where the
# environment sets PYTHONDONTWRITEBYTECODE.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup browser demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "CUDA found: installing torch from the default index"; \
		$(PY) -m pip install -q --no-compile "torch>=2.11"; \
	else \
		echo "no CUDA: installing the CPU build torch==2.13.0"; \
		$(PY) -m pip install -q --no-compile torch==2.13.0; \
	fi
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	touch $(STAMP)

# The demo runs the bundled kestrel-tiny model: offline generation, then one chat request through `kestrel serve`.
demo: $(STAMP)
	$(VENV)/bin/kestrel generate --prompt "def __init__(self" --prompt "import os" --max-tokens 48
	$(PY) scripts/demo_chat.py

# The playground's browser test (tests/server/test_playground.py) drives Debian's headless Chromium through its
# chromedriver; Selenium never downloads a browser. Installed here when missing (CI starts on a fresh machine).
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		echo "installing Debian's chromium and chromium-driver for the browser test"; \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium chromium-driver; \
	fi

# The tests marked `serial` hold time bounds that other work on the same cores would break: they run after the
# rest, alone (pytest's exit status 5 is "none selected"), collected from the files that spell out
# `pytest.mark.serial` only (tests/conftest.py refuses a serial test elsewhere). The rest run in TEST_WORKERS pytest
# processes (pytest-xdist, each file whole on one worker and in its order; times in docs/benchmarks.md);
# TEST_WORKERS=0 runs them in make's own pytest process.
TEST_WORKERS ?= 2

test: $(STAMP) browser
	$(VENV)/bin/ruff check kestrel training tests scripts
	$(PY) -m pytest -x --durations=25 -n $(TEST_WORKERS) --dist loadfile -m "not serial"
	$(PY) -m pytest -x --durations=10 -m serial $$(grep -rl --include='test_*.py' --include='*_test.py' 'pytest.mark.serial' tests) \
		|| [ $$? -eq 5 ]

lint: $(STAMP)
	$(VENV)/bin/ruff check kestrel training tests scripts

clean:
	rm -rf $(VENV) .models
