# bp-mech: `make book` builds the book, `make test` runs every test (including a strict book build).
# Both create .venv with the TRAIN-CPU profile when it is missing or out of date.
PYTHON ?= python3
# make book and make test run torch on one thread per process: two test workers (and the pages' kernel beside
# them) on two cores; with torch's default of one thread per core each process's OpenMP threads wait on the
# others' (make test: 19 CPU-minutes and 9.7 min of pytest on a clean clone at the default, 13 and 7.3 at one
# thread). One thread also makes the pages' live runs the same on every machine, whatever its cores. Tests that
# measure threads set them themselves; `make records` keeps the default.
# Bytecode is written by the first process that imports a module, into the venv and src/ (both ignored by git):
# these machines set PYTHONDONTWRITEBYTECODE, under which every page's process would compile torch and transformers
# again (a cold build took 215 s instead of 133 s), so make unexports it. Compiling the whole venv ahead instead
# (compileall on every core) spent 34 s on 14,000 modules of which the book and the tests import about 5,000:
# a cold `make book` took 153 s that way and 140 s this way, side by side on one quiet machine.
unexport PYTHONDONTWRITEBYTECODE
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-train-cpu
REQS   := requirements/torch-cpu.txt requirements/training-mechanism.txt requirements/book.txt

.PHONY: venv book test records clean preflight mutation
venv: $(STAMP)

$(STAMP): $(REQS) pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile $(foreach r,$(REQS),-r $(r))
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -m pip check
	touch $@

book: $(STAMP)   ## the book, every page executed, warnings as errors; kept while the sources are unchanged
	OMP_NUM_THREADS=1 $(PY) tools/book_build.py

test: $(STAMP)   ## every test on two workers; the book is built once (make book's build when it is current)
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadscope

records: $(STAMP)   ## refresh the cached CPU records and the computed records (fake-tensor traces, the sweep)
	rm -f book/results/*__cpu-*.json book/results/computed/*.json
	$(VENV)/bin/bp-mech run --suite cpu --out book/results
	$(PY) -m bp_mech.book.computations
	$(PY) tools/book_build.py --records

mutation: $(STAMP)   ## mutation score of the graded code under the exercise checks (about an hour on two cores; not in make test)
	$(PY) -m pip install --quiet -r requirements/mutation.txt
	nice -n 10 $(PY) tools/mutation.py $(CHAPTERS)

preflight: $(STAMP)
	$(VENV)/bin/bp-mech preflight --profile TRAIN-CPU

clean:
	rm -rf _build
