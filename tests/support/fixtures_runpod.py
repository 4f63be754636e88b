"""Fixtures for the RunPod fake (``tests/support/runpod_fake.py``): one fake process per test
module, reset (jobs, counters, knobs) before each test that uses it."""

from __future__ import annotations

import pytest

from tests.support.runpod_fake import KEY, FakeRunpod


@pytest.fixture(scope="module")
def runpod_fake_process():
    with FakeRunpod({"api_key": KEY}) as fake:
        yield fake


@pytest.fixture
def runpod(runpod_fake_process):
    """The module's RunPod fake, with fresh jobs, counters and knobs."""
    runpod_fake_process.reset()
    return runpod_fake_process
