# `make capture`: matched vLLM runs (one per KV-cache dtype) under Nsight Systems. Included from the main
# Makefile; every variable can also be given on the command line:
#   make capture MODEL=/models/llama-3.1-8b [SCENARIO=cold-prefill] [OUT=runs/x] [ARMS=fp8,nvfp4]
#                [MODE=serve|offline] [REPEATS=N] [DRY_RUN=1] [FORCE=1] [CAPTURE_ARGS='--load-format dummy']
#                [VLLM_ARGS='--max-model-len 8192']
# Without SCENARIO it records the seed's whole matrix (cold-prefill, decode-heavy, prefix-reuse, sweep), each
# scenario into OUT/SCENARIO (OUT defaults to runs/vllm-matrix), and ends with `kvtrace matrix OUT`. SCENARIO=one
# of them records that one alone, into OUT (default runs/vllm-SCENARIO). REPEATS=N records each arm N times, arms
# interleaved. DRY_RUN=1 prints every run's commands and needs no GPU. CAPTURE_ARGS go to `kvtrace capture
# vllm`, VLLM_ARGS to vLLM in both arms, split at spaces (no quoting inside them). OUT counts only when given
# on the command line (the main Makefile's OUT default is for other targets).
KVTRACE ?= kvtrace
MATRIX_SCENARIOS := cold-prefill decode-heavy prefix-reuse sweep
ARMS ?= fp8,nvfp4
MODE ?= serve

# The values reach the shell through the environment and are quoted there ("$$CAPTURE_MODEL"), never pasted
# into the command line, so a quote, `;` or `$` in them is text: nothing in them runs. $(value X) keeps a `$`
# that make would otherwise expand (/models/$HOME stays /models/$HOME).
capture: export CAPTURE_MODEL = $(value MODEL)
capture: export CAPTURE_SCENARIO = $(value SCENARIO)
capture: export CAPTURE_ARMS = $(value ARMS)
capture: export CAPTURE_MODE = $(value MODE)
capture: export CAPTURE_OUT = $(value OUT)
capture: export CAPTURE_REPEATS = $(value REPEATS)
capture: export CAPTURE_EXTRA = $(value CAPTURE_ARGS)
capture: export CAPTURE_VLLM_ARGS = $(value VLLM_ARGS)

.PHONY: capture
capture:
	@test -n "$$CAPTURE_MODEL" || { echo "usage: make capture MODEL=<model dir or Hugging Face id> [SCENARIO=...] [OUT=...] [ARMS=...] [MODE=serve|offline] [REPEATS=N] [DRY_RUN=1]" >&2; exit 2; }
	@set -f; one() { $(KVTRACE) capture vllm --model "$$CAPTURE_MODEL" --scenario "$$1" \
	  --arms "$$CAPTURE_ARMS" --mode "$$CAPTURE_MODE" $${2:+--out "$$2"} \
	  $(if $(value REPEATS),--repeats "$$CAPTURE_REPEATS") $(if $(value DRY_RUN),--dry-run) \
	  $(if $(value FORCE),--force) $$CAPTURE_EXTRA $(if $(value VLLM_ARGS),-- $$CAPTURE_VLLM_ARGS); }; \
	if [ -n "$$CAPTURE_SCENARIO" ]; then \
	  one "$$CAPTURE_SCENARIO" $(if $(filter command line,$(origin OUT)),"$$CAPTURE_OUT"); \
	else \
	  root="$(if $(filter command line,$(origin OUT)),$$CAPTURE_OUT,runs/vllm-matrix)"; failed=; \
	  for scenario in $(MATRIX_SCENARIOS); do echo "== $$scenario -> $$root/$$scenario"; \
	    one "$$scenario" "$$root/$$scenario" || failed="$$failed $$scenario"; done; \
	  $(if $(value DRY_RUN),,$(KVTRACE) matrix "$$root" || exit $$?;) \
	  if [ -n "$$failed" ]; then echo "make capture: failed:$$failed (see each run's manifest.json)" >&2; exit 1; fi; \
	fi
