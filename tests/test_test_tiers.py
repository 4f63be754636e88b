"""The fast tier (``bash scripts/test.sh --fast``) holds no test that needs a server or workers."""

from __future__ import annotations

import functools
import inspect
import pathlib
import socket
import subprocess

import pytest

from tests.support import tiers

TESTS = pathlib.Path(__file__).resolve().parent
# Fixtures that reach a real server or start processes, named independently of tiers.py.
NEEDS_SERVER = {
    "redis_url",
    "private_redis",
    "silent_redis",
    "celery_cluster",
    "race_cluster",
    "amqp_vhosts",
    "runpod_fake_process",
}
# Text that in a fixture's or test's own code starts a process.
STARTS_PROCESS = (
    "subprocess",
    "Popen",
    "multiprocessing",
    "FakeRunpod(",
    "FakeCerebrium(",
    "start_worker(",
    "start_workers(",
    "start_redis_server",
    "ProcessPoolExecutor",
)


class _Collected:
    def __init__(self) -> None:
        self.items: list[pytest.Item] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = list(session.items)


def _collect(*args: str) -> list[pytest.Item]:
    collected = _Collected()
    code = pytest.main(
        ["--collect-only", "-q", "-p", "no:cacheprovider", *args, str(TESTS)], plugins=[collected]
    )
    assert code == pytest.ExitCode.OK, f"collecting {args} exited {code!r}"
    return collected.items


@functools.cache
def _source(func: object) -> str:
    try:
        return inspect.getsource(inspect.unwrap(func))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def _own_code_starts_process(item: pytest.Item) -> bool:
    funcs = [getattr(item, "obj", None)]
    for name in item.fixturenames:  # type: ignore[attr-defined]
        funcs += [d.func for d in item._fixtureinfo.name2fixturedefs.get(name, ())]  # type: ignore[attr-defined]
    return any(text in _source(f) for f in funcs for text in STARTS_PROCESS)


def _check_fast(fast: list[pytest.Item]) -> None:
    assert fast and all(item.get_closest_marker("fast") for item in fast)
    using = {i.nodeid: sorted(NEEDS_SERVER & set(i.fixturenames)) for i in fast}  # type: ignore[attr-defined]
    assert not {k: v for k, v in using.items() if v}
    assert not [i.nodeid for i in fast if _own_code_starts_process(i)]


def test_the_fast_tests_of_this_run_use_no_server_or_worker_fixture(request):
    """In ``--fast`` this checks the whole selection at no cost; in a full run, its fast part."""
    items = request.session.items
    if request.config.getoption("--fast"):
        assert all(item.get_closest_marker("fast") for item in items)
    _check_fast([item for item in items if item.get_closest_marker("fast")])


@pytest.fixture(scope="module")
def collected() -> dict[str, list[pytest.Item]]:
    return {"all": _collect(), "fast": _collect("--fast")}


@pytest.mark.slow  # two whole collections of the suite
def test_the_fast_tier_uses_no_server_or_worker_fixture_and_starts_no_process(collected):
    _check_fast(collected["fast"])


@pytest.mark.slow  # two whole collections of the suite
def test_the_full_run_holds_what_the_fast_tier_leaves_out(collected):
    everything, fast = collected["all"], {i.nodeid for i in collected["fast"]}
    assert fast < {i.nodeid for i in everything}
    for fixture, mark in (
        ("redis_url", "redis"),
        ("celery_cluster", "celery"),
        ("runpod_fake_process", "server"),
    ):
        users = [i for i in everything if fixture in i.fixturenames]
        assert users, f"no test uses {fixture}: this check would prove nothing"
        assert all(i.get_closest_marker(mark) and i.nodeid not in fast for i in users)
    starting = [i for i in everything if _own_code_starts_process(i)]
    assert starting and not [i.nodeid for i in starting if i.nodeid in fast]


def test_process_starts_are_found_through_helpers_and_cli_commands():
    assert tiers._spawns("tests.support.cerebrium_fake", "FakeCerebrium", set())
    assert tiers._spawns("tests.support.runpod_fake", "FakeRunpod", set())  # via its base
    assert not tiers._spawns("tests.support.http_provider_server", "HttpProviderServer", set())
    assert tiers._command_spawns(("bench", "report")) and tiers._command_spawns(("demo",))
    assert not tiers._command_spawns(("budget",))


def test_the_fast_tiers_guard_refuses_processes_and_the_test_servers_then_steps_aside():
    before = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    with tiers.ProcessGuard() as guard:
        with pytest.raises(AssertionError, match="does not start processes"):
            subprocess.run(["true"], check=False)
        for host, port in guard.servers:
            with pytest.raises(AssertionError, match="does not reach the test servers"):
                socket.create_connection((host, port), timeout=1)
    assert subprocess.Popen._execute_child is before  # type: ignore[attr-defined]
