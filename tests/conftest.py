"""The Triton-interpreter scripts of the collected tests (their `interp` markers, tests/interp_runner.py) start when
collection ends, one after another in a background thread; their tests run last and wait for the results."""
from interp_runner import HAS_TRITON, marked, prestart, stop


def pytest_collection_modifyitems(session, config, items):
    if HAS_TRITON:  # the interpreter tests last (stable order otherwise), by then their scripts have run beside
        items.sort(key=lambda it: marked(it) is not None)


def pytest_collection_finish(session):
    prestart([m for m in map(marked, session.items) if m is not None])


def pytest_sessionfinish(session, exitstatus):
    stop()
