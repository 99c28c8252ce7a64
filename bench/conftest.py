"""Benchmarks: `pytest bench/ --benchmark` times them; without the flag each body runs once as a smoke test."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_addoption(parser):
    parser.addoption("--benchmark", action="store_true", default=False,
                     help="time the benchmark suites (default: run each body once as a smoke test)")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # before pytest-benchmark builds its session: without --benchmark it runs each body once, untimed
    if not config.getoption("--benchmark"):
        config.option.benchmark_disable = True
