"""``gpuhedge-celery experiment PREREG.yaml [--dry-run] [--out FILE] --go``: a preregistered
comparison of policies on live traffic.

The YAML (``config/experiments/example.yaml``, ``docs/measuring.md``) fixes the arms (a policy
each, optionally with its providers), ``blocks_per_arm`` blocks of ``block_size`` requests per
arm, the ``seed`` that shuffles the blocks, the ``cadence_s`` between requests and the one
``primary_metric``. The blocks run in the seeded order; each request is one race through the
workers, started on schedule (a slow race never delays the next one), tagged with its arm, so
its race record carries ``arm`` and ``report --by arm`` compares the arms. Once every race has
finished the command prints the report by arm and each arm's primary metric, and ``--out``
writes the experiment's records (an ``experiment_plan`` line, then one race record per request)
for ``report``.

``--dry-run`` prints the order and the worst-case spend and sends nothing (exit 0); without
``--go`` the same plan is printed and the command exits 2. Exit codes: 0 done, 1 a race left no
record, 2 a dry run without ``--dry-run`` or bad input, 3 Redis unreachable.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from ..core.experiment import Prereg, Slot, parse_prereg, primary_value, schedule
from ..errors import ConfigError, GpuHedgeError
from ._spend import gate, go_option
from .race import celery_app, start_race, worst_case

RECORD_WAIT_S = 30.0  # after the last result: every loser's cancel settles, its record lands


def load_prereg(path: str) -> Prereg:
    """Read and validate a preregistration file (one-line errors naming the key and file)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read ({e.strerror})", file=path) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"not YAML{where}", file=path) from None
    return parse_prereg(data, path)


def arm_worst_cases(plan: Prereg, cfg: Any) -> dict[str, float]:
    """Each arm's worst-case spend per request, its policy checked against the config."""
    from ..race.spec import build_spec

    found = {}
    for i, arm in enumerate(plan.arms):
        names = list(arm.providers) if arm.providers else None
        try:
            spec = build_spec(cfg, arm.policy, names, arm=arm.name)
        except ConfigError as e:
            raise ConfigError(str(e), file=plan.source, key=f"arms[{i}]") from None
        found[arm.name] = worst_case(spec, cfg.budget, cfg)[1]
    return found


def plan_text(plan: Prereg, worst: dict[str, float]) -> list[str]:
    """The plan as printed by a dry run: arms, order, requests."""
    lines = [
        f"experiment {plan.name}: {plan.requests} request(s), {len(plan.arms)} arms x "
        f"{plan.blocks_per_arm} block(s) x {plan.block_size}, one every {plan.cadence_s:g} s "
        f"(about {plan.requests * plan.cadence_s:g} s); primary metric {plan.primary_metric}"
        + (f" (deadline {plan.deadline_s:g} s)" if plan.primary_metric == "miss_rate" else ""),
    ]
    for arm in plan.arms:
        providers = f" on {','.join(arm.providers)}" if arm.providers else ""
        lines.append(
            f"  arm {arm.name}: {arm.policy}{providers}, worst case "
            f"${worst[arm.name]:,.4f} per request"
        )
    blocks = [s for s in schedule(plan) if (s.index % plan.block_size) == 0]
    lines.append(f"block order (seed {plan.seed}): " + " ".join(s.arm for s in blocks))
    return lines


def _run(plan: Prereg) -> list[tuple[Slot, str]]:
    """Send every request on schedule; (slot, race id) each, once every race has ended."""
    app = celery_app()
    sent: list[tuple[Slot, Any]] = []
    start = time.monotonic()
    for slot in schedule(plan):
        time.sleep(max(0.0, start + slot.at_s - time.monotonic()))
        arm = plan.arm(slot.arm)
        res = start_race(
            app,
            dict(plan.request),
            policy=arm.policy,
            arm=arm.name,
            providers=list(arm.providers) if arm.providers else None,
        )
        sent.append((slot, res))
        click.echo(
            f"request {slot.index + 1}/{plan.requests} block {slot.block} arm {arm.name}: "
            f"race {res.id}",
            err=True,
        )
    for _, res in sent:
        try:
            res.get(timeout=plan.timeout_s, propagate=False)
        except Exception as e:  # a timeout: the record wait below reports the race
            click.echo(f"race {res.id}: no result within {plan.timeout_s:g} s ({e})", err=True)
    return [(slot, res.id) for slot, res in sent]


def redis_now_ms() -> int:
    """Now on the Redis server's clock (the records stream's entry ids use it)."""
    from ..cli import cli_redis_client
    from ..store.connection import translate_errors

    with translate_errors():
        seconds, micros = cli_redis_client().time()
    return int(seconds) * 1000 + int(micros) // 1000


def collect_records(race_ids: list[str], since_ms: int) -> dict[str, dict[str, Any]]:
    """The latest record of each race, read from the records stream (waits for late ones)."""
    from ..cli import cli_redis_client, root_settings
    from ..settings import current
    from ..store.connection import translate_errors
    from ..store.records import RecordStream

    root = root_settings()
    shards = current().race_shards(root.prefix, root.redis_url)  # every shard's stream
    stream = RecordStream(cli_redis_client(), root.prefix, shards=shards)
    wanted, found = set(race_ids), {}
    deadline = time.monotonic() + RECORD_WAIT_S
    with translate_errors():
        while True:
            for _, record in stream.read(since_ms=since_ms):
                if record.get("race_id") in wanted:
                    found[record["race_id"]] = record
            if len(found) == len(wanted) or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)


def summary(plan: Prereg, records: list[dict[str, Any]]) -> list[str]:
    """The report by arm and each arm's primary metric."""
    from ..core.report import RequestSet, summarise
    from .report import format_table

    requests = RequestSet()
    requests.add((f"race {r['race_id']}", r) for r in records)
    rows = summarise(requests.requests(), "arm", [plan.deadline_s])
    lines = format_table(rows, "arm", [plan.deadline_s])
    lines.append("")
    lines.append(f"primary metric {plan.primary_metric}:")
    for row in rows:
        value = primary_value(row, plan.primary_metric, plan.deadline_s)
        shown = "n/a" if value is None else f"{value:.6g}"
        lines.append(f"  {row['group']}: {shown} (n {row['n']})")
    return lines


@click.command(name="experiment")
@click.argument("prereg", type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Print the order and worst case; send nothing.")
@click.option("--out", "out_path", default=None, help="Write the experiment's records (JSONL).")
@go_option
def command(prereg: str, dry_run: bool, out_path: str | None, go: bool) -> None:
    """Run the preregistered comparison PREREG (YAML); a dry run unless --go."""
    from ..cli import root_config

    plan = load_prereg(prereg)
    cfg = root_config()
    worst = arm_worst_cases(plan, cfg)
    total = sum(worst[a.name] * plan.blocks_per_arm * plan.block_size for a in plan.arms)
    lines = plan_text(plan, worst)
    if dry_run:
        click.echo("\n".join(lines))
        click.echo(f"worst-case spend: ${total:,.4f}")
        return
    gate(go, lines, total)
    out = None
    if out_path:
        try:
            out = open(out_path, "w", encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as e:
            raise ConfigError(f"cannot write {out_path}: {e.strerror}", key="--out") from None
    since_ms = redis_now_ms()  # every record of this experiment's races is newer
    try:
        sent = _run(plan)
        found = collect_records([race_id for _, race_id in sent], since_ms)
        records = []
        for slot, race_id in sent:
            if race_id in found:
                records.append({**found[race_id], "block": slot.block})
        if out is not None:
            out.write(
                json.dumps(
                    {
                        "kind": "experiment_plan",
                        **plan.to_dict(),
                        "order": [s.arm for s in schedule(plan)],
                        "worst_case_usd": round(total, 6),
                    }
                )
                + "\n"
            )
            for record in records:
                out.write(json.dumps(record) + "\n")
    finally:
        if out is not None:
            out.close()
    if records:
        click.echo("\n".join(summary(plan, records)))
    missing = len(sent) - len(records)
    if missing:
        raise GpuHedgeError(
            f"{missing} of {len(sent)} race(s) left no record within {RECORD_WAIT_S:g} s "
            "(records off on the workers? GPUHEDGE_RECORDS_MAXLEN)"
        )
    if out_path:
        click.echo(
            f"wrote {len(records)} record(s) to {out_path}; "
            f"gpuhedge-celery report {out_path} --by arm"
        )
