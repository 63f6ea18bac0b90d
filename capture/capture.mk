# `make capture`: matched vLLM runs (one per KV-cache dtype) under Nsight Systems. Included from the main
# Makefile; every variable can also be given on the command line:
#   make capture MODEL=/models/llama-3.1-8b [SCENARIO=cold-prefill] [OUT=runs/x] [ARMS=fp8,nvfp4]
#                [MODE=serve|offline] [REPEATS=N] [DRY_RUN=1] [FORCE=1] [CAPTURE_ARGS='--load-format dummy']
#                [VLLM_ARGS='--max-model-len 8192']
# Without SCENARIO it records the whole capacity matrix with `kvtrace capture vllm-matrix` (cold prefill, prefix
# reuse, preemption, the sweep; one server per arm, 3 interleaved rounds, a trace window in every point's traffic),
# each scenario into OUT/SCENARIO (OUT defaults to runs/vllm-matrix), and ends with `kvtrace matrix OUT`; MODE does
# not apply to it (the matrix is served). SCENARIO=one of cold-prefill, decode-heavy, prefix-reuse, sweep records
# that one alone with `kvtrace capture vllm`, into OUT (default runs/vllm-SCENARIO). REPEATS=N records each arm N
# times, arms interleaved (default 3 served, 1 offline). DRY_RUN=1 prints the commands, or the matrix's whole plan
# with its estimated time, and needs no GPU. CAPTURE_ARGS go to `kvtrace capture
# vllm`, VLLM_ARGS to vLLM in both arms, split at spaces (no quoting inside them). OUT counts only when given
# on the command line (the main Makefile's OUT default is for other targets).
KVTRACE ?= kvtrace
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

# Options both commands take, each value quoted from the environment as above.
CAPTURE_FLAGS = $(if $(value REPEATS),--repeats "$$CAPTURE_REPEATS") $(if $(value DRY_RUN),--dry-run) \
  $(if $(value FORCE),--force)

.PHONY: capture
capture:
	@test -n "$$CAPTURE_MODEL" || { echo "usage: make capture MODEL=<model dir or Hugging Face id> [SCENARIO=...] [OUT=...] [ARMS=...] [MODE=serve|offline] [REPEATS=N] [DRY_RUN=1]" >&2; exit 2; }
	@set -f; \
	if [ -n "$$CAPTURE_SCENARIO" ]; then \
	  $(KVTRACE) capture vllm --model "$$CAPTURE_MODEL" --scenario "$$CAPTURE_SCENARIO" --arms "$$CAPTURE_ARMS" \
	    --mode "$$CAPTURE_MODE" $(if $(filter command line,$(origin OUT)),--out "$$CAPTURE_OUT") $(CAPTURE_FLAGS) \
	    $$CAPTURE_EXTRA $(if $(value VLLM_ARGS),-- $$CAPTURE_VLLM_ARGS); \
	else \
	  root="$(if $(filter command line,$(origin OUT)),$$CAPTURE_OUT,runs/vllm-matrix)"; \
	  $(KVTRACE) capture vllm-matrix --model "$$CAPTURE_MODEL" --arms "$$CAPTURE_ARMS" --out "$$root" $(CAPTURE_FLAGS) \
	    $$CAPTURE_EXTRA $(if $(value VLLM_ARGS),-- $$CAPTURE_VLLM_ARGS); captured=$$?; \
	  $(if $(value DRY_RUN),exit $$captured;) \
	  $(KVTRACE) matrix "$$root" || exit $$?; \
	  if [ $$captured != 0 ]; then echo "make capture: the matrix did not record every run (see $$root/matrix.json" \
	    "and each scenario's manifest.json)" >&2; exit 1; fi; \
	fi
