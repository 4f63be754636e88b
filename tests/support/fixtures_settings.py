"""Every test starts from settings read from its own environment.

``settings.current()`` keeps what a process read once; a test that changed the environment
(``monkeypatch.setenv``, a CLI run that read it) would otherwise leave its values to the tests
after it. A test that changes the environment mid-test calls ``settings.reload()`` itself.
"""

from __future__ import annotations

import pytest

from gpuhedge_celery import settings


@pytest.fixture(autouse=True)
def fresh_settings():
    settings.reload()
    yield
    settings.reload()
