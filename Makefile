# kvtrace — `make demo` diffs the shipped real traces (H100 and H200); `make test` runs the test suite.
PYTHON ?= python3
PIP := $(PYTHON) -m pip install -q --disable-pip-version-check
# Debian's Nsight Systems 2023.4.4 CLI for the `nsys stats` cross-check (shared/ci beside the checkout).
NSYS_INSTALLER := $(wildcard ../shared/ci/install-nsys-cli.sh)
# The FlashInfer FP8 vs NVFP4 kernel A/B with Gaussian inputs, shipped packed, per release: the newest leads (the
# release vLLM 0.33 ships, recorded on an H100), the older one is history (the same command and inputs on an H200).
DEMO_RELEASE := 0.7.2.post1
DEMO_RUN := fi-h100-sm90-gaussian-fi$(DEMO_RELEASE)
HISTORY_RELEASE := 0.6.16.post3
HISTORY_RUN := fi-h200-sm90-gaussian
OUT ?= out
DEMO := $(OUT)/$(DEMO_RUN)
HISTORY_DEMO := $(OUT)/$(HISTORY_RUN)
# The real vLLM 0.33 pair (H200, FP8 vs NVFP4 KV cache, offline decode-heavy), shipped packed.
VLLM_DEMO_PACK := fixtures/vllm033-h200/offline-decode-heavy.tar.xz
VLLM_DEMO := $(OUT)/vllm033-offline-decode-heavy
# The capacity-bound region on the Llama-3.1-8B-shaped model (issues 33, 46): the whole matrix in one capture (cold
# prefill, prefix reuse past FP8's pool, the preemption case, the sweep across FP8's capacity; 3 interleaved rounds, a
# traced pass per point), recorded on an H100, shipped packed; and the counterfactual arm (issue 47) of the first
# such recording, whose timed traffic the profiler stalled (its cold prefill excepted).
CAPACITY_PACK := fixtures/vllm033-h100-matrix/vllm033-h100-matrix.tar.xz
CAPACITY_DEMO := $(OUT)/vllm033-h100-matrix
COUNTERFACTUAL_PACK := fixtures/vllm033-h100-counterfactual/vllm033-h100-counterfactual.tar.xz
COUNTERFACTUAL_DEMO := $(OUT)/vllm033-h100-counterfactual

# Test processes (pytest-xdist): auto is one per core.
TEST_WORKERS ?= auto

.PHONY: install install-dev demo test test-fast docs capture bench bench-export bench-export-h200

install:
	$(PIP) -e .

# torch's CPU build (2.13.0) is enough for the capture/formats tests; pinned here, not in pyproject.
install-dev:
	$(PIP) 'torch==2.13.0'
	$(PIP) -e '.[test]'

demo: install
	mkdir -p $(OUT)
	rm -rf $(VLLM_DEMO) && tar -xJf $(VLLM_DEMO_PACK) -C $(OUT)
	cd $(VLLM_DEMO) && kvtrace diff fp8.sqlite nvfp4.sqlite
	rm -rf $(DEMO) && tar -xJf fixtures/$(DEMO_RUN)/$(DEMO_RUN).tar.xz -C $(OUT)
	@echo "FlashInfer $(DEMO_RELEASE) (the release vLLM 0.33 ships), NVIDIA H100: $(DEMO_RUN)"
	kvtrace diff $(DEMO)/fp8.sqlite $(DEMO)/nvfp4.sqlite
	kvtrace diff $(DEMO)/fp8.sqlite $(DEMO)/nvfp4.sqlite --format markdown -o $(OUT)/demo-diff.md
	kvtrace diff $(DEMO)/fp8.sqlite $(DEMO)/nvfp4.sqlite --format json -o $(OUT)/demo-diff.json
	kvtrace report $(DEMO) --format markdown -o $(OUT)/demo-report.md --plots $(OUT)/plots
	rm -rf $(CAPACITY_DEMO) && tar -xJf $(CAPACITY_PACK) -C $(OUT)
	kvtrace matrix $(CAPACITY_DEMO)
	kvtrace matrix $(CAPACITY_DEMO) --format markdown -o $(OUT)/demo-capacity.md --plots $(OUT)/capacity-plots
	rm -rf $(COUNTERFACTUAL_DEMO) && tar -xJf $(COUNTERFACTUAL_PACK) -C $(OUT)
	kvtrace matrix $(COUNTERFACTUAL_DEMO)/counterfactual --format markdown -o $(OUT)/demo-counterfactual.md
	kvtrace report $(CAPACITY_DEMO)/preemption --format markdown -o $(OUT)/demo-preemption.md
	rm -rf $(HISTORY_DEMO) && tar -xJf fixtures/$(HISTORY_RUN)/$(HISTORY_RUN).tar.xz -C $(OUT)
	@echo "History, FlashInfer $(HISTORY_RELEASE), NVIDIA H200, the same workload: $(HISTORY_RUN)"
	kvtrace diff $(HISTORY_DEMO)/fp8.sqlite $(HISTORY_DEMO)/nvfp4.sqlite
	kvtrace report $(HISTORY_DEMO) --format markdown -o $(OUT)/demo-fi$(HISTORY_RELEASE).md
	@echo "vLLM 0.33 FP8 vs NVFP4 run directory: $(VLLM_DEMO)"
	@echo "FlashInfer $(DEMO_RELEASE) on the H100, markdown: $(OUT)/demo-diff.md, JSON: $(OUT)/demo-diff.json"
	@echo "its report with quality and plots: $(OUT)/demo-report.md ($(OUT)/plots/; drag $(OUT)/plots/summary.png into the issue)"
	@echo "the capacity matrix (8B shape on an H100: cold prefill, prefix reuse, preemption, sweep; 3 rounds): $(OUT)/demo-capacity.md (the TTFT budget per point: $(OUT)/capacity-plots/budget.png); the preemption case: $(OUT)/demo-preemption.md; NVFP4 with FlashInfer's host check run once (the first recording): $(OUT)/demo-counterfactual.md"
	@echo "history, FlashInfer $(HISTORY_RELEASE) on the H200 (the same workload; NVFP4's prefill strays from its own cache there): $(OUT)/demo-fi$(HISTORY_RELEASE).md"

# Python may cache bytecode while the tests run: the suite starts hundreds of kvtrace processes, and an environment
# with PYTHONDONTWRITEBYTECODE set had each of them compile every module afresh.
test test-fast: export PYTHONDONTWRITEBYTECODE =

test: install-dev
	@if [ -n "$(NSYS_INSTALLER)" ]; then export NSYS=$$(bash $(NSYS_INSTALLER)); fi; \
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist worksteal

# The suite less the tests marked slow (end-to-end runs); `make test` and CI run everything.
test-fast: install-dev
	@if [ -n "$(NSYS_INSTALLER)" ]; then export NSYS=$$(bash $(NSYS_INSTALLER)); fi; \
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not slow"

# Grows the vLLM fixtures to 10M, 30M and 100M kernels per file under bench/out/ (a pair is skipped, and says so,
# when the disk cannot hold it; 100M pairs need 20 to 40 GB and are removed once measured) and times kvtrace
# against the two floors (sqlite3 GROUP BY; bench/floor.c, built with $(CC) and the SQLite headers: apt-get
# install libsqlite3-dev) and `nsys stats`, then stage by stage; the tables go into docs/performance.md.
# BENCH_FLAGS go to bench/run.py (--baseline DIR, --keep-up-to KERNELS, …; see bench/run.py --help).
BENCH_FLAGS ?=
bench: install
	@if [ -n "$(NSYS_INSTALLER)" ]; then export NSYS=$$(bash $(NSYS_INSTALLER)); fi; \
	$(PYTHON) bench/run.py --sizes 10000000 30000000 100000000 $(BENCH_FLAGS) && $(PYTHON) bench/stages.py && \
	$(PYTHON) bench/stages.py --workload decode-heavy

# From .nsys-rep reports to the answer (docs/performance.md, "Export"): every nsys export path, its read and a
# whole diff, side by side, on REPORTS (default: the committed 2023.4 pair, which the installed nsys opens).
REPORTS ?= fixtures/fi-h200-sm90-nsys2023/fp8.nsys-rep fixtures/fi-h200-sm90-nsys2023/nvfp4.nsys-rep
bench-export: install
	@if [ -z "$$NSYS" ] && [ -n "$(NSYS_INSTALLER)" ]; then export NSYS=$$(bash $(NSYS_INSTALLER)); fi; \
	$(PYTHON) bench/export.py $(REPORTS)

# On the GPU machine (torch with CUDA, NSYS set by .gpu/nsys-env.sh, the analyzer's packages from bench/h200-deps.sh):
# records a pair of CUDA-graph-loop reports per size into bench/out/graph-loop and runs bench/export.py on each.
# kvtrace is not installed there: the package is laid out in KV_COPY, as fixtures/record-flashinfer-h200.sh does.
# RECORD_FLAGS go to bench/graph_loop.py (e.g. --eager --at-once), EXPORT_FLAGS to bench/export.py; the 10M rows
# come from bench/export-10m-h200.sh (docs/performance.md).
SIZES ?= 1000000
KV_COPY ?= /tmp/kv
RECORD_FLAGS ?=
EXPORT_FLAGS ?= --repeat 1
bench-export-h200:
	rm -rf $(KV_COPY) && mkdir -p $(KV_COPY) && cp -r kvtrace $(KV_COPY)/ && cp -r analyzer capture recipes $(KV_COPY)/kvtrace/
	export PYTHONPATH=$(KV_COPY)$${PYTHONPATH:+:$$PYTHONPATH}; \
	$(PYTHON) bench/graph_loop.py --record bench/out/graph-loop --kernels $(SIZES) $(RECORD_FLAGS) && \
	for n in $(SIZES); do $(PYTHON) bench/export.py $(EXPORT_FLAGS) bench/out/graph-loop/a-$$n.nsys-rep \
		bench/out/graph-loop/b-$$n.nsys-rep || exit 1; done

docs: install
	$(PYTHON) -m kvtrace.docs > docs/cli.md

include capture/capture.mk
