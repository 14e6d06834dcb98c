# Every target makes its own virtual environment in .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Python writes each module's bytecode when it first imports it (the install compiles nothing ahead:
# it is the longest part of a fresh install, and most of what the packages hold is never imported);
# every process after the first then loads it instead of compiling the module again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test check lint site docs slow chaos soak soak-replicas bench bench-scale fuzz clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)  ## the main job (see README)
	$(VENV)/bin/croupier demo

# NOTE: the in-process tests run in three workers on the two cores (pytest-xdist: they wait on
# fsyncs, PostgreSQL and timeouts for a third of their time, and three finish sooner than two or
# four here); the end-to-end runs, which start processes of their own, run two at a time (each takes
# the next when it is done; three at a time took longer; the tests of a file that resume one
# module-scoped run are one xdist_group, run by one worker), but for those that assert a stall, a
# latency or a duration (SERIAL in tests/conftest.py), which run alone. The suite is bound by CPU
# (about 1,450 s of it on 2 cores): running the in-process tests at a lower priority beside the
# end-to-end runs saved nothing, and beside those that run alone it failed them.
test: lint site  ## everything CI runs: lint, types, the docs site, and the whole default suite (end-to-end runs included)
	$(PY) -m pytest -q -n 3 -m "not slow and not e2e" --durations=10
	$(PY) -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -m "e2e and paired and not slow" --durations=25
	$(PY) -m pytest -q -m "e2e and not paired and not slow" --durations=25

# NOTE: make check runs lint, types and the docs site beside its tests (out/check-lint.log, printed after them).
check: $(STAMP)  ## the fast lane for the edit loop: lint, types, the in-process tests (property tests draw a fifth of their cases, the state machine 12 examples of each kind of job, one fixed search)
	@mkdir -p out
	@$(MAKE) --no-print-directory lint site >out/check-lint.log 2>&1 & lint=$$!; \
	CROUPIER_QUICK=1 CROUPIER_SM_EXAMPLES=12 $(PY) -m pytest -q -x -n 3 -m "not slow and not e2e and not exhaustive"; \
	tests=$$?; wait $$lint; rc=$$?; \
	echo "== lint, types and the docs site (beside the tests above):"; cat out/check-lint.log; \
	[ $$tests -eq 0 ] && [ $$rc -eq 0 ]

lint: $(STAMP)  ## ruff and mypy (strict on core, server, client)
	$(VENV)/bin/ruff check .
	$(PY) scripts/typecheck.py

# MkDocs reads mkdocs.yml: docs/ and the API reference from the docstrings (scripts/docs_hooks.py).
site: $(STAMP)  ## the docs site, built in strict mode (a broken link, anchor or API reference fails) into out/site
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

docs: $(STAMP)  ## the docs site, served on http://127.0.0.1:8000 (rebuilt on every change)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --strict

slow: $(STAMP)  ## the long runs: 5000-example state machine, 200 coordinator kills, 100-fault chaos, 30-fault token and dynamic chaos, and the end-to-end variants the suite keeps one of
	$(PY) -m pytest -q -m slow -s

chaos: $(STAMP)  ## the full chaos run (100 faults), audited
	$(VENV)/bin/croupier chaos

soak: $(STAMP)  ## 1,000 faults mixed (kills, preemptions, rollbacks, coordinator and worker pauses, clock jumps, a full disk, partitions, a slow lossy link) on one job, audited, its call history checked linearizable: under two hours (105 min here); as root with libfaketime
	$(VENV)/bin/croupier chaos --datacenter --faults 1000 --epochs 70 --step-ms 200 --workdir out/soak

soak-replicas: $(STAMP)  ## 200 faults mixed on one job and 3 replicas on a PostgreSQL server of the run's own, each on a host of its own (replica kills and pauses, PostgreSQL restarts, a replica cut from the database or the job, slow lossy links, rank kills and pauses, preemptions), audited, its journal and call history checked: about half an hour; as root with PostgreSQL's server binaries
	$(VENV)/bin/croupier chaos --datacenter --replicas 3 --faults 200 --epochs 16 --step-ms 200 --workdir out/soak-replicas

bench: $(STAMP)  ## every benchmark: one table (out/bench/bench.md) and one plot (out/bench/bench.png)
	$(PY) benchmarks/bench.py

bench-scale: $(STAMP)  ## the join storm (1,024 to 16,384 ranks) and steady training of 16,384 ranks on this tree's coordinator and on the threaded one of 42a3d40, beside this machine's grpc.aio ceiling; 10,000 waiting joins on both; a coordinator of 1,000 jobs recovered after kill -9: out/bench/scale.md, scale.png and waiting.md
	mkdir -p out/bench
	$(PY) benchmarks/scale_bench.py --baseline 42a3d40 --jobs 1000 --events 1000000 --snapshot-every 100000 --steady 16384 --steady-lease 256,16 --out out/bench/scale.md
	$(PY) benchmarks/waiting_bench.py --baseline 42a3d40 --ranks 10000 --window 10 --poll-ms 5000,30000 --out out/bench/waiting.md

fuzz: $(STAMP)  ## ten minutes of coverage-guided fuzzing of every RPC's request bytes (fuzz/rpc_fuzz.py)
	mkdir -p out/fuzz
	$(PY) fuzz/rpc_fuzz.py -max_total_time=600 -print_final_stats=1 -artifact_prefix=out/fuzz/

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
