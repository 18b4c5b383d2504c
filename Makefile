# The two commands a newcomer needs:  make demo   and   make test
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test clean

setup:
	./scripts/bootstrap.sh

demo: setup
	$(VENV)/bin/reap-swap demo

# pytest's exit code 5 ("no tests collected") is a failure here too: CI must run tests.
test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf out .pytest_cache
