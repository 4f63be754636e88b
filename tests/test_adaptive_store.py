"""What adaptive policies share through a real Redis: request numbers, a hedge budget that
holds for the fleet and spends once per race and role, the observation stream, and reset."""

from __future__ import annotations

import pytest

from gpuhedge_celery.core.adaptive_learn import CAPACITY
from gpuhedge_celery.store.adaptive import AdaptiveStore

pytestmark = pytest.mark.cluster

NAME = "adaptive:p->h@d60s+b0.5"


@pytest.fixture
def store(redis_client, prefix) -> AdaptiveStore:
    return AdaptiveStore(redis_client, prefix)


def test_requests_are_numbered_and_refill_a_capped_bucket(store: AdaptiveStore) -> None:
    assert store.next_request(NAME, 0.5) == (1, CAPACITY)  # starts full, refill capped
    assert store.take_token(NAME) and store.take_token(NAME)
    assert store.next_request(NAME, 0.5) == (2, CAPACITY - 1.5)
    assert store.next_request("adaptive:p->h@d60s", None) == (1, None)  # no budget: no tokens


def test_an_empty_bucket_refuses_and_a_race_role_spends_once(store: AdaptiveStore) -> None:
    spent = sum(store.take_token(NAME, f"race{i}:hedge") for i in range(int(CAPACITY) + 3))
    assert spent == CAPACITY
    assert store.counts(NAME)["tokens"] == 0.0
    assert store.take_token(NAME, "race0:hedge")  # it has one already: no second spent
    assert not store.take_token(NAME, "race99:hedge")
    store.next_request(NAME, 0.5)
    assert not store.take_token(NAME, "race99:hedge")  # half a token is none
    store.next_request(NAME, 0.5)
    assert store.take_token(NAME, "race99:hedge")
    assert store.counts(NAME)["tokens"] == 0.0


def test_observations_come_back_in_order_bad_entries_skipped(store: AdaptiveStore) -> None:
    store.append_seen(NAME, {"seq": 1, "jobs": []})
    store.client.xadd(store.keys.adaptive_seen(NAME), {"o": "not json"})
    store.append_seen(NAME, {"seq": 2, "jobs": []})
    seen = list(store.seen_since(NAME))
    assert [o["seq"] for _, o in seen] == [1, 2]
    assert list(store.seen_since(NAME, seen[0][0]))[0][1]["seq"] == 2
    assert store.seen_count(NAME) == 3


def test_reset_forgets_observations_budget_and_plan(store: AdaptiveStore) -> None:
    store.next_request(NAME, 0.5)
    store.take_token(NAME)
    store.append_seen(NAME, {"seq": 1, "jobs": []})
    store.publish(NAME, {"plan": {"hedge": "h"}})
    assert store.policies() == [NAME]
    store.reset(NAME)
    counts = store.counts(NAME)
    assert "tokens" not in counts and "plan" not in counts and counts["reset"] == 1
    assert store.seen_count(NAME) == 0
