"""Sentinel URLs: parsed, completed from the environment, redacted, and handed to Celery."""

from __future__ import annotations

import pytest
import redis

from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.redis_url import (
    celery_ssl_options,
    celery_transport_options,
    celery_url,
    location,
    parse_sentinel_url,
    redact_url,
)
from gpuhedge_celery.shared_settings import Settings
from gpuhedge_celery.tasks.app import celery_conf
from gpuhedge_celery.tasks.config import GlueConfig

GROUP = "sentinel://:dat4pw@10.0.0.1:26379/2;sentinel://10.0.0.2:26380;sentinel://10.0.0.3"


def test_a_group_url_names_every_sentinel_the_database_and_the_data_password():
    spec = parse_sentinel_url(GROUP + "?master=cache&sentinel_password=s3nt&ssl=true")
    assert spec.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("10.0.0.3", 26379))
    assert (spec.master, spec.db, spec.password, spec.sentinel_password, spec.ssl) == (
        "cache", 2, "dat4pw", "s3nt", True,
    )  # fmt: skip


def test_the_environment_completes_the_url_and_the_url_wins():
    env = {"GPUHEDGE_REDIS_URL": GROUP, "GPUHEDGE_REDIS_SENTINEL_MASTER": "cache",
           "GPUHEDGE_REDIS_SENTINEL_PASSWORD": "s3nt"}  # fmt: skip
    spec = parse_sentinel_url(Settings.from_env(env).redis_url)
    assert (spec.master, spec.sentinel_password) == ("cache", "s3nt")
    env["GPUHEDGE_REDIS_URL"] = GROUP + "?master=other"
    assert parse_sentinel_url(Settings.from_env(env).redis_url).master == "other"


@pytest.mark.parametrize(
    "url, says",
    [
        (GROUP, "master's name"),
        ("sentinel://h:26379;redis://h:6379/0?master=m", "sentinel://host:port"),
        ("sentinel://h:notaport/0?master=m", "bad port"),
        ("sentinel://h:26379/zero?master=m", "database must be a number"),
        ("sentinel://:dat4pw@h:notaport/0?master=m", "bad port"),
        # Celery and kombu read the first Sentinel's: a later one saying otherwise is refused
        ("sentinel://h1:26379;sentinel://h2:26379/3?master=m", "first Sentinel"),
        ("sentinel://:a@h1:26379;sentinel://:dat4pw@h2:26379?master=m", "first Sentinel"),
    ],
)
def test_a_bad_group_url_is_one_line_naming_the_variable(url, says):
    with pytest.raises(ConfigError, match="GPUHEDGE_REDIS_URL") as info:
        Settings.from_env({"GPUHEDGE_REDIS_URL": url})
    assert says in str(info.value) and "\n" not in str(info.value)
    assert "dat4pw" not in str(info.value)


def test_no_password_survives_redaction_or_the_settings_repr():
    url = GROUP + "?master=cache&sentinel_password=s3nt"
    shown = redact_url(url) + repr(Settings(redis_url=url)) + location(url)
    assert "dat4pw" not in shown and "s3nt" not in shown
    assert "10.0.0.3" in shown and "cache" in shown


def test_celery_gets_the_url_without_our_query_and_the_master_as_a_transport_option():
    url = GROUP + "?master=cache&sentinel_password=s3nt"
    assert celery_url(url) == GROUP
    assert celery_transport_options(url) == {
        "master_name": "cache", "sentinel_kwargs": {"password": "s3nt"},
    }  # fmt: skip
    assert celery_url("redis://h:6379/0") == "redis://h:6379/0"
    assert celery_transport_options("redis://h:6379/0") == {}


def test_store_results_and_broker_all_follow_the_same_group():
    config = GlueConfig.from_env({"GPUHEDGE_REDIS_URL": GROUP + "?master=cache"})
    conf = celery_conf(config)
    assert config.broker_kind == "redis"  # visibility timeout and the restore sweep still apply
    assert conf["broker_url"] == conf["result_backend"] == GROUP
    assert conf["broker_transport_options"]["master_name"] == "cache"
    assert conf["broker_transport_options"]["visibility_timeout"] == config.visibility_timeout_s
    assert conf["result_backend_transport_options"]["master_name"] == "cache"
    assert "dat4pw" not in repr(config.as_celery_conf()) + repr(config)


def test_a_broker_group_of_its_own_takes_the_master_from_the_environment():
    env = {"GPUHEDGE_REDIS_URL": "redis://r:6379/1", "GPUHEDGE_REDIS_SENTINEL_MASTER": "q",
           "GPUHEDGE_BROKER_URL": "sentinel://b1:26379;sentinel://b2:26379/0"}  # fmt: skip
    conf = celery_conf(GlueConfig.from_env(env))
    assert conf["broker_url"] == "sentinel://b1:26379;sentinel://b2:26379/0"
    assert conf["broker_transport_options"]["master_name"] == "q"
    assert conf["result_backend"] == "redis://r:6379/1"
    assert "master_name" not in conf["result_backend_transport_options"]


def test_the_same_database_and_password_may_be_repeated_on_every_sentinel():
    url = "sentinel://:dat4pw@h1:26379/2;sentinel://:dat4pw@h2:26379/2?master=m"
    spec = parse_sentinel_url(url)
    assert (spec.db, spec.password, len(spec.sentinels)) == (2, "dat4pw", 2)


def test_every_password_in_the_query_is_hidden_however_it_is_spelled():
    for url in (
        GROUP + "?master=m&sentinel%5Fpassword=s3nt",
        "redis://h:6379/0?password=s3nt",
        "sentinel://:dat4pw@h:notaport/0?master=m",
    ):
        assert "s3nt" not in redact_url(url) and "dat4pw" not in redact_url(url), url


def test_tls_reaches_celery_for_the_data_nodes_and_the_sentinels():
    url = GROUP + "?master=cache&ssl=true&ssl_ca_certs=/etc/ca.pem"
    conf = celery_conf(GlueConfig.from_env({"GPUHEDGE_REDIS_URL": url}))
    wanted = {"ssl_cert_reqs": "required", "ssl_ca_certs": "/etc/ca.pem"}
    assert conf["broker_use_ssl"] == conf["redis_backend_use_ssl"] == wanted
    sentinels = conf["result_backend_transport_options"]["sentinel_kwargs"]
    assert sentinels == {"ssl": True, "ssl_ca_certs": "/etc/ca.pem"}
    assert celery_ssl_options(GROUP + "?master=cache") is None
    plain = GlueConfig.from_env({"GPUHEDGE_REDIS_URL": GROUP + "?master=cache"})
    assert "broker_use_ssl" not in celery_conf(plain)


def test_a_sentinel_broker_keeps_the_transport_that_survives_a_lost_connection():
    conf = celery_conf(GlueConfig.from_env({"GPUHEDGE_REDIS_URL": GROUP + "?master=cache"}))
    assert conf["broker_transport"] == "gpuhedge_celery.tasks.broker:SentinelTransport"
    from gpuhedge_celery.tasks.broker import SentinelTransport

    assert SentinelTransport.Channel.QoS.__module__ == "gpuhedge_celery.tasks.broker"


@pytest.mark.parametrize(
    "error",
    [
        redis.ReadOnlyError("You can't write against a read only replica."),
        redis.ResponseError(
            "UNBLOCKED force unblock from blocking operation, instance state changed "
            "(master -> replica?)"
        ),
        redis.ResponseError(
            "Command # 2 (WAIT 1 200) of pipeline caused error: UNBLOCKED force unblock from "
            "blocking operation, instance state changed (master -> replica?)"
        ),
    ],
)
def test_a_demoted_primary_is_an_outage_to_retry_not_a_failed_command(error):
    from gpuhedge_celery.errors import StoreError, StoreUnavailable
    from gpuhedge_celery.store.connection import translate_errors
    from gpuhedge_celery.store.timers import store_errors

    with pytest.raises(StoreUnavailable, match="stopped being the primary"):
        with store_errors("claiming the winner"):
            raise error
    with pytest.raises(StoreUnavailable, match="stopped being the primary"):
        with translate_errors():
            raise error
    with pytest.raises(StoreError) as info:  # any other refusal stays a failed command
        with store_errors("claiming the winner"):
            raise redis.ResponseError("ERR wrong number of arguments")
    assert not isinstance(info.value, StoreUnavailable)
