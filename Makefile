# Two commands: `make demo` and `make test`. Everything else is their plumbing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TINY := .models/llama-tiny

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "CUDA found: installing torch from the default index"; \
		$(PY) -m pip install -q "torch>=2.11"; \
	else \
		echo "no CUDA: installing the CPU build torch==2.13.0"; \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

$(TINY): $(STAMP)
	$(VENV)/bin/kestrel model-init --arch llama --size tiny $(TINY)

demo: $(STAMP) $(TINY)
	$(VENV)/bin/kestrel generate --model $(TINY) --prompt "The quick brown fox" --max-tokens 24
	$(PY) scripts/demo_chat.py --model $(TINY)

test: $(STAMP)
	$(VENV)/bin/ruff check kestrel tests scripts
	$(PY) -m pytest -x

lint: $(STAMP)
	$(VENV)/bin/ruff check kestrel tests scripts

clean:
	rm -rf $(VENV) .models
