# `make capture`: matched vLLM runs (one per KV-cache dtype) under Nsight Systems. Included from the main
# Makefile; every variable can also be given on the command line:
#   make capture MODEL=/models/llama-3.1-8b [SCENARIO=cold-prefill] [OUT=runs/x] [ARMS=fp8,nvfp4]
#                [MODE=serve|offline] [REPEATS=N] [DRY_RUN=1] [FORCE=1] [CAPTURE_ARGS='--load-format dummy']
#                [VLLM_ARGS='--max-model-len 8192']
# SCENARIO: cold-prefill, decode-heavy, prefix-reuse or sweep. REPEATS=N records each arm N times, arms
# interleaved. DRY_RUN=1 prints every run's commands and needs no GPU. CAPTURE_ARGS go to `kvtrace capture
# vllm`, VLLM_ARGS to vLLM in both arms. OUT counts only when given on the command line (the main Makefile's OUT default is for other targets); without it the run
# goes to runs/vllm-SCENARIO.
KVTRACE ?= kvtrace
SCENARIO ?= cold-prefill
ARMS ?= fp8,nvfp4
MODE ?= serve

.PHONY: capture
capture:
	@test -n "$(MODEL)" || { echo "usage: make capture MODEL=<model dir or Hugging Face id> [SCENARIO=...] [OUT=...] [ARMS=...] [MODE=serve|offline] [REPEATS=N] [DRY_RUN=1]" >&2; exit 2; }
	$(KVTRACE) capture vllm --model '$(MODEL)' --scenario '$(SCENARIO)' --arms '$(ARMS)' --mode '$(MODE)' \
	  $(if $(filter command line,$(origin OUT)),--out '$(OUT)') $(if $(REPEATS),--repeats '$(REPEATS)') \
	  $(if $(DRY_RUN),--dry-run) $(if $(FORCE),--force) $(CAPTURE_ARGS) $(if $(VLLM_ARGS),-- $(VLLM_ARGS))
