"""A real ``celery -A gpuhedge_celery flower`` refuses to start with basic-auth credentials that
protect nothing (an empty password, an empty user, an entry without ``user:password``): one
line on stderr, exit status 2, and no port opened. Good credentials start it as before
(``tests/test_flower_auth.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpuhedge_celery.tasks.flower_auth import basic_auth_problem, is_flower_command
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]


def run_flower(redis_url, tmp_path, *args, **env):
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
    full_env.update(GPUHEDGE_REDIS_URL=redis_url, **env)
    argv = [sys.executable, "-m", "celery", "-A", "gpuhedge_celery", "flower",
            f"--port={port}", "--address=127.0.0.1", *args]  # fmt: skip
    # a Flower that starts never exits by itself: the timeout is the failure
    return subprocess.run(argv, env=full_env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=30)  # fmt: skip


@pytest.mark.parametrize(
    "env, args, fragment",
    [
        # the README's line with FLOWER_PASSWORD unset
        ({"FLOWER_BASIC_AUTH": "ops:"}, (), "FLOWER_BASIC_AUTH: entry 1 gives user 'ops' an "
                                            "empty password"),
        ({"FLOWER_BASIC_AUTH": ":secret-pw"}, (), "FLOWER_BASIC_AUTH: entry 1 has an empty user"),
        ({"FLOWER_BASIC_AUTH": "opssecret-pw"}, (), "entry 1 has no ':' between user and"),
        ({"FLOWER_BASIC_AUTH": "ops:secret-pw,bob:"}, (), "entry 2 gives user 'bob' an empty"),
        ({}, ("--basic-auth=ops:",), "--basic-auth: entry 1 gives user 'ops' an empty password"),
    ],
)  # fmt: skip
def test_flower_refuses_credentials_that_protect_nothing(redis_url, tmp_path, env, args,
                                                         fragment):  # fmt: skip
    done = run_flower(redis_url, tmp_path, *args, **env)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    assert "secret-pw" not in done.stderr + done.stdout  # the entry itself is never echoed


def test_the_check_reads_every_entry_of_both_sources():
    good = {"FLOWER_BASIC_AUTH": "ops:pw,bob:pw2"}
    assert basic_auth_problem(good, ["celery", "flower", "--basic-auth=x:y"]) is None
    assert basic_auth_problem({}, ["celery", "flower"]) is None  # no basic auth: Flower's 401s
    assert "entry 1" in basic_auth_problem({"FLOWER_BASIC_AUTH": ""}, [])
    assert "--basic_auth: entry 2" in basic_auth_problem({}, ["--basic_auth=a:b,c"])


def test_only_the_flower_command_is_checked():
    assert is_flower_command(["/usr/bin/celery", "-A", "gpuhedge_celery", "flower"])
    assert is_flower_command(["/x/site-packages/celery/__main__.py", "-A", "x", "flower"])
    assert not is_flower_command(["/usr/bin/celery", "-A", "gpuhedge_celery", "worker"])
    assert not is_flower_command(["/usr/bin/pytest", "-k", "flower"])
