# Every target sets itself up on a fresh machine: a local .venv, torch 2.13.0 (CPU build) when no torch is
# importable, then this package with its dev, hf and monitor extras
# (constraints.txt pins torch so no extra pulls another build).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardspeed-installed
ARGS ?=
export OMP_NUM_THREADS ?= 1

.PHONY: setup test test-all lint demo bench bench-tp bench-pipe bench-compressed-collective gpu-check clean bench-compression-convergence bench-analyzer bench-curriculum bench-autotune

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev,hf,monitor,hpo]' -c constraints.txt
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# `test` is CI's suite (under 20 minutes on 2 cores); `test-all` adds the tests marked slow (convergence runs,
# fault tables, large matrices).
test: lint
	$(PY) -m pytest -q -m "not slow"

test-all: lint
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m shardspeed.demo $(ARGS)

# The engine rows (ZeRO 0-3 vs DDP / ZeroRedundancyOptimizer / FSDP2, before/after issue #16, exposed
# communication); DS_PYTHON names a venv's python with deepspeed 0.19.x for DeepSpeed's rows. E.g.
# `make bench ARGS="--model all"`.
bench: $(STAMP)
	$(PY) benchmarks/bench_engine.py $(if $(DS_PYTHON),--deepspeed-python $(DS_PYTHON)) $(ARGS)

# The autotuner on the demo model (issue 19): tuner vs default config vs an exhaustive grid, points pruned by the
# memory model, predicted vs measured memory. Real trials: tens of minutes on 2 cores (ARGS to reduce the space).
bench-autotune: $(STAMP)
	$(PY) benchmarks/bench_autotune.py $(ARGS)

# Tensor parallelism (TP=2, 2 gloo ranks) against torch DTensor parallelize_module on the same GPT.
bench-tp: $(STAMP)
	$(PY) benchmarks/bench_tp_dtensor.py $(ARGS)

# Pipeline parallelism (PP=2, 2 gloo ranks) against torch.distributed.pipelining (GPipe, 1F1B) and, when
# DS_PYTHON names a venv's python with deepspeed 0.19.8 (see the script's docstring), DeepSpeed's PipelineModule.
bench-pipe: $(STAMP)
	$(PY) benchmarks/bench_pipe.py $(if $(DS_PYTHON),--deepspeed-python $(DS_PYTHON)) $(ARGS)

.PHONY: bench-compression-speed bench-hpo
# 1-bit compressed all-reduce / reduce-scatter against fp32 (bytes, time), real gloo and a SIMULATED 10 / 1 Gbit/s link.
bench-compressed-collective: $(STAMP)
	$(PY) benchmarks/bench_compressed_collective.py $(ARGS)

# 1-bit Adam (compressed phase) vs Adam, stage 0, on a SIMULATED link of 0.1 / 1 / 10 Gbit/s (comm-bound MLP).
bench-compression-speed: $(STAMP)
	$(PY) benchmarks/bench_compression_speed.py $(ARGS)

# 1-bit optimizers (and ZeRO-2 1-bit Adam) against themselves with compression off: final-loss table + loss curves PNG.
# E.g. `make bench-compression-convergence ARGS="--optimizers zero2-onebitadam --worlds 2"`.
bench-compression-convergence: $(STAMP)
	$(PY) benchmarks/bench_compression_convergence.py $(ARGS)

# The seqlen curriculum on the demo GPT: held-out loss vs tokens with and without it (PNG), short-sequence throughput.
bench-curriculum: $(STAMP)
	$(PY) benchmarks/bench_curriculum.py $(ARGS)

# shardspeed data-analyze's throughput on a synthetic 1M-sample token dataset, e.g.
# `make bench-analyzer ARGS="--map-samples 200000 --workers 1 2 4"`.
bench-analyzer: $(STAMP)
	$(PY) benchmarks/bench_data_analyzer.py $(ARGS)
# Hyper-parameter search on the toy task with a measured good lr range (real 2-rank trials; ~1 min per trial on
# 2 busy cores). ARGS: --trials N, --lr-range-test, --results-dir DIR.
bench-hpo: $(STAMP)
	$(PY) benchmarks/bench_hpo.py $(ARGS)
# Element-wise compute per phase of the compressed all-reduce (one thread, no communication).
.PHONY: bench-compression-phases
bench-compression-phases: $(STAMP)
	$(PY) benchmarks/bench_compression_phases.py $(ARGS)

# The CUDA path in one command (under 8 minutes on one GPU): world-1 CUDA tests, gloo ranks on CUDA tensors, NCCL
# multi-rank tests (>= 2 GPUs) and the benchmark rows on CUDA; one summary table. CPU-only: each check skipped with
# its reason, exit status 0. ARGS: --quick, --json OUT.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
