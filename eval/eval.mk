# Evaluation targets, included by the top-level Makefile (which defines PY and MODEL).
# CPU defaults: the tiny model, one server at a time, each target well under 30 minutes.
# On GPUs:  make sweep-concurrency MODEL=Qwen/Qwen3-30B-A3B DEVICE=cuda TP=2 EVAL_FLAGS="--max-total-tokens 200000 ..."
PY ?= .venv/bin/python
MODEL ?= models/tiny-qwen3-moe
DEVICE ?= cpu
TP ?= 1
EVAL_FLAGS ?=
RESULTS ?= results
EVAL_RUN = OMP_NUM_THREADS=1 $(PY) -m eval.runners
EVAL_ARGS = --model $(MODEL) --device $(DEVICE) --tp $(TP) $(EVAL_FLAGS)

.PHONY: ablation-ratio ablation-policy sweep-concurrency report eval-all demo-multinode soak bench-decision \
	bench-staging bench-staging-server cachesim cachesim-figures bench-host-experts bench-decode-cost \
	bench-speculative

ablation-ratio:
	$(EVAL_RUN) ablation-ratio $(EVAL_ARGS) --out-dir $(RESULTS)/ablation-ratio

ablation-policy:
	$(EVAL_RUN) ablation-policy $(EVAL_ARGS) --out-dir $(RESULTS)/ablation-policy

sweep-concurrency:
	$(EVAL_RUN) sweep-concurrency $(EVAL_ARGS) --out-dir $(RESULTS)/sweep-concurrency

report:
	$(PY) -m eval.report $(RESULTS)

eval-all: sweep-concurrency ablation-ratio ablation-policy report

# TP 2 over two "nodes" on loopback (the rank controller on TCP + CURVE): both nodes, then TP 2 and TP 1.
demo-multinode: model
	OMP_NUM_THREADS=1 $(PY) -m eval.demo_multinode --model $(MODEL)

# Does VAMP stay up? 30 minutes per TP size (1, then 2) of the multi-turn workload with client
# aborts and VAMP_SGLANG_FAULT=remap:0.2; exits non-zero on a failed request, RSS growth or a page leak.
SOAK_MINUTES ?= 30
soak: model
	OMP_NUM_THREADS=1 $(PY) -m eval.soak --model $(MODEL) --minutes $(SOAK_MINUTES) --out $(RESULTS)/soak

# What one decision costs on a 10,000-node tree, against SGLang's own eviction.
bench-decision: install
	OMP_NUM_THREADS=1 $(PY) -m eval.bench_decision --json $(RESULTS)/bench_decision.json

# Whole-region vs routed-only vs auto staging (issue 12): the MoE layer path at decode batch 1/4/16/64 and a
# prefill (table, JSON, plot), then TPOT of ratio 0 vs VAMP-25 whole / auto on real servers at 1, 4, 16 sessions.
bench-staging: install
	OMP_NUM_THREADS=1 $(PY) -m eval.bench_staging --json $(RESULTS)/bench_staging.json

bench-staging-server: model
	OMP_NUM_THREADS=1 $(PY) -m eval.bench_staging_server --model $(MODEL) --json $(RESULTS)/bench_staging_server.json

# Prefix-cache simulator (issue 23): the multi-turn workload through SGLang's real tree per policy and the
# offline optimum, pool sizes 25-100% of the reusable footprint; JSON and plot (docs: eval/cachesim/).
cachesim: install
	$(PY) -m eval.make_trace multiturn --sessions 12 --out $(RESULTS)/cachesim/multiturn.jsonl
	OMP_NUM_THREADS=1 $(PY) -m eval.cachesim --trace $(RESULTS)/cachesim/multiturn.jsonl \
		--pool-tokens 0.25x,0.5x,0.75x,1x --policies lru,lfu,slru,vamp,opt,bound \
		--json $(RESULTS)/cachesim/multiturn.json --plot $(RESULTS)/cachesim/multiturn.png

# The README's three simulator figures (docs/img/cachesim-*.png): every policy, plain and with sessions closed.
CACHESIM_SWEEP = OMP_NUM_THREADS=1 $(PY) -m eval.cachesim --pool-tokens 0.25x,0.5x,0.75x,1x \
	--policies lru,lfu,vamp,opt,bound --close-sessions
cachesim-figures: model
	$(PY) -m eval.make_trace multiturn --sessions 12 --out $(RESULTS)/cachesim/multiturn.jsonl
	$(PY) -m eval.make_trace mooncake --max-requests 2000 --scale 0.0625 --out $(RESULTS)/cachesim/mooncake.jsonl
	$(PY) -m eval.make_trace sweagent --scale 0.25 --model-path $(MODEL) --out $(RESULTS)/cachesim/sweagent.jsonl
	for trace in multiturn mooncake sweagent; do \
		$(CACHESIM_SWEEP) --trace $(RESULTS)/cachesim/$$trace.jsonl --json $(RESULTS)/cachesim/$$trace-all.json \
			--plot docs/img/cachesim-$$trace.png || exit 1; \
	done

# Decode cost on real GPUs by staging mode (issue 49). bench-host-experts times one expert's matmuls on one
# core of this CPU (bf16 and fp32, 1-64 tokens; median of repeated rounds, the machine is shared);
# bench-decode-cost replays the routing traces in ../shared/research/routing-data (read in place) and
# `uniform` through VAMP's layout and routed-staging code, prices them for each GPU profile, and writes the
# JSON (+ details) and the plot (docs: docs/staging.md).
DECODE_COST = $(RESULTS)/decode_cost
bench-host-experts: install
	OMP_NUM_THREADS=1 $(PY) -m eval.bench_host_experts --repeats 15 --json $(DECODE_COST)/host_experts.json

bench-decode-cost: install
	@test -f $(DECODE_COST)/host_experts.json || $(MAKE) bench-host-experts
	OMP_NUM_THREADS=1 $(PY) -m eval.bench_decode_cost --profile h100-pcie,h200 --json $(DECODE_COST)/decode_cost.json \
		--plot $(DECODE_COST)/decode_cost.png

# Speculative decoding with VAMP (issue 46, docs/speculative.md): the multi-turn workload (8 sessions) against
# ratio 0 and VAMP-20 with the same draft on a 4,096-token pool and ratio 0 without one on a 32,768-token pool,
# for the tiny DeepSeek-V3 with its MTP draft (EAGLE) and the tiny Qwen3-MoE with its EAGLE3 draft; about
# 10 minutes a model here. Summaries results/speculative/{deepseek,qwen3}.json and tpot_split.png.
bench-speculative: install
	OMP_NUM_THREADS=1 $(PY) -m eval.bench_speculative deepseek --out-dir $(RESULTS)/speculative
	OMP_NUM_THREADS=1 $(PY) -m eval.bench_speculative qwen3 --out-dir $(RESULTS)/speculative
