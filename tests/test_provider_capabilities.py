"""Each adapter's optional capabilities, as the race's watch and the webhook receiver see them
(the small Protocols in providers/base.py, checked with isinstance): one renamed method would
silently turn a webhook provider into a polled one, or a batched poll into single ones."""

from __future__ import annotations

import pytest

from gpuhedge_celery.providers.base import (
    CancelsBehindQueued,
    HintsNextChange,
    PollsMany,
    PollsWithHint,
    TakesWebhooks,
)
from gpuhedge_celery.providers.cerebrium import CerebriumProvider
from gpuhedge_celery.providers.http import HttpProvider
from gpuhedge_celery.providers.modal import ModalProvider
from gpuhedge_celery.providers.pool import PoolProvider
from gpuhedge_celery.providers.runpod import RunpodProvider
from gpuhedge_celery.providers.sim import SimProvider

CAPABILITIES = (HintsNextChange, PollsWithHint, PollsMany, TakesWebhooks, CancelsBehindQueued)


@pytest.mark.parametrize(
    ("adapter", "expected"),
    [
        (RunpodProvider, {PollsWithHint, TakesWebhooks, CancelsBehindQueued}),
        (CerebriumProvider, {TakesWebhooks}),
        (SimProvider, {HintsNextChange, PollsWithHint, PollsMany}),
        (PoolProvider, {HintsNextChange, PollsMany}),
        (ModalProvider, set()),
        (HttpProvider, set()),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_each_adapter_declares_the_capabilities_it_has(adapter, expected):
    assert {c for c in CAPABILITIES if issubclass(adapter, c)} == expected
