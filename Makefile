# kvtrace — `make demo` diffs the shipped real H200 traces; `make test` runs the test suite.
PYTHON ?= python3
PIP := $(PYTHON) -m pip install -q --disable-pip-version-check
# Debian's Nsight Systems 2023.4.4 CLI for the `nsys stats` cross-check (shared/ci beside the checkout).
NSYS_INSTALLER := $(wildcard ../shared/ci/install-nsys-cli.sh)
DEMO := fixtures/fi-h200-sm90
OUT ?= out

.PHONY: install install-dev demo test docs capture bench

install:
	$(PIP) -e .

# torch's CPU build (2.13.0) is enough for the capture/formats tests; pinned here, not in pyproject.
install-dev:
	$(PIP) 'torch==2.13.0'
	$(PIP) -e '.[test]'

demo: install
	kvtrace diff $(DEMO)/fp8.sqlite $(DEMO)/nvfp4.sqlite
	mkdir -p $(OUT)
	kvtrace diff $(DEMO)/fp8.sqlite $(DEMO)/nvfp4.sqlite --format markdown -o $(OUT)/demo-diff.md
	kvtrace diff $(DEMO)/fp8.sqlite $(DEMO)/nvfp4.sqlite --format json -o $(OUT)/demo-diff.json
	kvtrace report $(DEMO) --format markdown -o $(OUT)/demo-report.md --plots $(OUT)/plots
	@echo "markdown report: $(OUT)/demo-diff.md, JSON: $(OUT)/demo-diff.json"
	@echo "serving report with plots: $(OUT)/demo-report.md ($(OUT)/plots/; drag $(OUT)/plots/summary.png into the issue)"

test: install-dev
	@if [ -n "$(NSYS_INSTALLER)" ]; then export NSYS=$$(bash $(NSYS_INSTALLER)); fi; \
	$(PYTHON) -m pytest

# Grows the vLLM fixtures to 1M and 10M kernels under bench/out/ (about 4 GB) and times kvtrace against the
# SQLite floor and `nsys stats`, then stage by stage; the tables go into docs/performance.md.
bench: install
	@if [ -n "$(NSYS_INSTALLER)" ]; then export NSYS=$$(bash $(NSYS_INSTALLER)); fi; \
	$(PYTHON) bench/run.py && $(PYTHON) bench/stages.py

docs: install
	$(PYTHON) -m kvtrace.docs > docs/cli.md

include capture/capture.mk
