"""``celery -A gpuhedge_celery flower`` refuses to start with basic-auth credentials that
protect nothing.

Flower compares the ``user:password`` a client sends with each configured entry as a string:
``FLOWER_BASIC_AUTH="ops:$FLOWER_PASSWORD"`` with ``FLOWER_PASSWORD`` unset becomes ``ops:``,
and Flower then serves its pages and API to ``curl -u ops:``, silently. So before Flower starts
(the app is loaded first: ``load_tasks``), every entry of ``FLOWER_BASIC_AUTH`` and of
``--basic-auth=`` must be ``user:password`` with both parts non-empty; otherwise the command
stops with one line naming where the bad entry is and what is wrong with it (never the entry
itself, which may hold a password), exit status 2.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

EXIT_CONFIG = 2  # as the gpuhedge-celery command's configuration errors
ENV = "FLOWER_BASIC_AUTH"
OPTIONS = ("--basic-auth=", "--basic_auth=")  # Flower (tornado) takes both spellings


def is_flower_command(argv: Sequence[str]) -> bool:
    """Whether this process is ``celery ... flower`` (``celery`` or ``python -m celery``)."""
    if not argv:
        return False
    program = argv[0].replace("\\", "/")
    is_celery = os.path.basename(program) == "celery" or program.endswith("celery/__main__.py")
    return is_celery and "flower" in argv[1:]


def basic_auth_problem(env: Mapping[str, str], argv: Sequence[str]) -> str | None:
    """What is wrong with the configured basic-auth entries (one line), or None."""
    sources = []
    if ENV in env:
        sources.append((ENV, env[ENV]))
    sources += [
        (arg.split("=", 1)[0], arg.split("=", 1)[1]) for arg in argv if arg.startswith(OPTIONS)
    ]
    for where, value in sources:
        # Flower splits on commas, as here: "a:1,b:2" is two users
        for number, entry in enumerate(value.split(","), start=1):
            user, colon, password = entry.partition(":")
            what = None
            if not colon:
                what = "has no ':' between user and password"
            elif not user.strip():
                what = "has an empty user"
            elif not password:
                what = f"gives user {user!r} an empty password (is the variable it came from set?)"
            if what is not None:
                return (
                    f"{where}: entry {number} {what}; expected user:password, both non-empty "
                    "(docs/flower.md)"
                )
    return None


def refuse_bad_basic_auth(
    env: Mapping[str, str] | None = None, argv: Sequence[str] | None = None
) -> None:
    """In ``celery ... flower``: stop with the one-line error when :func:`basic_auth_problem`
    finds one; elsewhere nothing."""
    argv = sys.argv if argv is None else argv
    if not is_flower_command(argv):
        return
    problem = basic_auth_problem(os.environ if env is None else env, argv)
    if problem is not None:
        print(f"error: {problem}", file=sys.__stderr__, flush=True)
        raise SystemExit(EXIT_CONFIG)
