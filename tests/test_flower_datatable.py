"""Flower's task list (``/tasks/datatable``, what its Tasks page shows) and its task API hold a
race's request size, never the request: a real Flower process on the workers' broker (the
fixture of ``tests/test_flower_real.py``), the worker sending task events (``-E``)."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.waiting import wait_for
from tests.test_flower_real import flower

pytestmark = pytest.mark.timeout(120)

__all__ = ["flower"]  # the fixture this module uses

SSN = "078-05-1120"
TABLE = {  # the query Flower's Tasks page sends: newest first, 100 rows
    "draw": 1,
    "start": 0,
    "length": 100,
    "search[value]": "",
    "order[0][column]": 0,
    "order[0][dir]": "desc",
    "columns[0][data]": "received",
}


def test_flowers_task_table_shows_a_requests_size_not_its_content(flower):
    request = {"sim": {"p": {"queue_s": 0, "run_s": 1}}, "patient": {"ssn": SSN}}
    res = flower.rc.send(request)
    assert res.get(timeout=20)["winner"] == "p"
    wait_for(
        lambda: (flower.task(res.id) or {}).get("state") == "SUCCESS",
        10,
        f"Flower to show the race done\n{flower.log()}",
    )
    table = flower.http.get("/tasks/datatable", params=TABLE).raise_for_status()
    rows = {row["uuid"]: row for row in table.json()["data"]}
    assert re.fullmatch(r"\(<request: [\d,]+ bytes>\)", rows[res.id]["args"]), rows[res.id]
    assert SSN not in table.text
    info = flower.task(res.id)
    assert info["args"] == rows[res.id]["args"] and SSN not in json.dumps(info)
