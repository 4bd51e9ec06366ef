"""``serve --ray``'s options, without starting Ray: ReplicaOptions' checks (each naming its flag), the shared-store
rule (Redis, or a tiered store with Redis behind it, once there are 2 replicas; passwords never shown), the
CPUs and threads each replica asks for, ``app_builder``'s unknown args, and ``build_application``, which only
builds deployment objects."""

from __future__ import annotations

import os

import pytest

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.server.options import ServerConfig
from cacheblend_rag.server.replicas.launch import (ReplicaOptions, app_builder, check_shared_store,
                                                   replica_resources)


# --------------------------------------------------------------------------- ReplicaOptions
@pytest.mark.parametrize("fields, flag", [
    ({"replicas": 0}, "--replicas"), ({"replicas": -2}, "--replicas"), ({"replicas": True}, "--replicas"),
    ({"replicas": 2.0}, "--replicas"), ({"replicas": "2"}, "--replicas"),
    ({"min_replicas": 0, "max_replicas": 2}, "--min-replicas"), ({"min_replicas": 1, "max_replicas": False},
                                                                  "--max-replicas"),
    ({"threads": 0}, "--replica-threads"), ({"spill_threshold": 0}, "spill_threshold"),
    ({"spill_threshold": True}, "spill_threshold"),
    ({"min_replicas": 1}, "--max-replicas"), ({"max_replicas": 4}, "--min-replicas"),
    ({"replicas": 5, "min_replicas": 1, "max_replicas": 3}, "--replicas 5"),
    ({"replicas": 1, "min_replicas": 2, "max_replicas": 3}, "--min-replicas 2"),
    ({"router": "random"}, "--router"), ({"router": None}, "--router"),
])
def test_bad_replica_options_are_config_errors_naming_the_flag(fields, flag):
    with pytest.raises(ConfigError, match=flag):
        ReplicaOptions(**fields)


def test_good_replica_options_and_their_most_replicas():
    assert ReplicaOptions().most_replicas == 2
    assert ReplicaOptions(replicas=3, router="default", threads=2).most_replicas == 3
    assert ReplicaOptions(replicas=2, min_replicas=1, max_replicas=4).most_replicas == 4
    assert ReplicaOptions(replicas=1, min_replicas=1, max_replicas=1).most_replicas == 1


# --------------------------------------------------------------------------- the shared store
@pytest.mark.parametrize("store", ["redis://127.0.0.1:6379/0", "rediss://:secret@h:6380/0", "redis://h/0?password=p",
                                   "tiered:/p,redis://h/0", "tiered:/var/kv,rediss://u:pw@h/1", "REDIS://h/0",
                                   "tiered:/p,Redis://h/0"])
def test_redis_is_a_shared_store(store):
    check_shared_store(store, 2)
    check_shared_store(store, 8)


@pytest.mark.parametrize("store", ["/tmp/kv", "./kv", "disk:/tmp/kv", "file:///tmp/kv", "memory", "memory:1GB",
                                   "tiered:/p", "tiered:/p,", "tiered:/p,memory", "tiered:/p,/other", None, "",
                                   "TIERED:/p,redis://h/0"])  # open_store reads no such tiered spec
def test_a_store_of_each_replicas_own_is_refused_from_2_replicas(store):
    check_shared_store(store, 1)  # one replica shares with nobody
    with pytest.raises(ConfigError, match="not shared") as refused:
        check_shared_store(store, 2)
    message = str(refused.value)
    assert "redis://" in message and "tiered:PATH,redis://" in message and "2 replicas" in message
    if not store:
        assert "--store (none)" in message


@pytest.mark.parametrize("store", ["tiered:/p, redis://:secret@h/0", "tiered:/p,memory,redis://u:secret@h/0",
                                   "http://:secret@h/0", "s3://user:secret@bucket/kv", "tiered:/p,x://:secret@h"])
def test_a_refused_store_does_not_show_its_password(store):
    with pytest.raises(ConfigError, match="not shared") as refused:
        check_shared_store(store, 3)
    assert "secret" not in str(refused.value) and "***" in str(refused.value)


# --------------------------------------------------------------------------- CPUs and threads
@pytest.mark.parametrize("cores, options, expected", [
    (2, ReplicaOptions(replicas=2), (1.0, 1)),
    (2, ReplicaOptions(replicas=1), (2.0, 2)),
    (16, ReplicaOptions(replicas=4), (4.0, 4)),
    (16, ReplicaOptions(replicas=3), (5.0, 5)),
    (16, ReplicaOptions(replicas=4, threads=2), (2.0, 2)),
    (16, ReplicaOptions(replicas=4, threads=8), (4.0, 8)),  # never more CPUs than its share, so Ray places all
    (4, ReplicaOptions(replicas=2, min_replicas=1, max_replicas=4), (1.0, 1)),  # shared out by the most replicas
    (None, ReplicaOptions(replicas=1), (1.0, 1)),
])
def test_a_local_ray_shares_the_cores_out(monkeypatch, cores, options, expected):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert replica_resources(options, local=True) == expected


@pytest.mark.parametrize("cores, replicas", [(2, 3), (2, 4), (1, 2), (4, 7)])
def test_more_replicas_than_cores_ask_for_fractions_of_one(monkeypatch, cores, replicas):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    cpus, threads = replica_resources(ReplicaOptions(replicas=replicas), local=True)
    assert 0 < cpus < 1 and threads == 1
    assert cpus * replicas <= cores  # rounded down to 2 places: Ray can place them all (0.67 x 3 > 2 would not)
    assert cores / replicas - 0.01 < cpus <= cores / replicas


def test_on_a_cluster_each_replica_asks_for_its_threads(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the front end's machine says nothing of the workers'
    assert replica_resources(ReplicaOptions(replicas=8), local=False) == (1.0, None)
    assert replica_resources(ReplicaOptions(replicas=8, threads=3), local=False) == (3.0, 3)


# --------------------------------------------------------------------------- the application
def test_app_builder_names_an_unknown_arg():
    with pytest.raises(ConfigError, match="replicaz") as refused:
        app_builder({"model": "tiny-llama", "store": "redis://h/0", "replicaz": 2, "router": "chunk"})
    assert "ray_address" not in str(refused.value).partition("known are")[2]  # not an arg of a config file
    with pytest.raises(ConfigError, match="--replicas"):
        app_builder({"model": "tiny-llama", "store": "redis://h/0", "replicas": 0})


def test_build_application_builds_deployments_without_starting_ray(monkeypatch):
    pytest.importorskip("ray.serve")
    import ray

    from cacheblend_rag.server.replicas.launch import build_application

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    config = ServerConfig(model="tiny-llama", store="redis://:secret@h/0")
    with pytest.raises(ConfigError, match="not shared"):
        build_application(ServerConfig(model="tiny-llama", store="memory"), ReplicaOptions(replicas=2))
    front = build_application(config, ReplicaOptions(replicas=3, spill_threshold=5))._bound_deployment
    engine = front.init_args[0]._bound_deployment
    assert (front.name, front.num_replicas, front.ray_actor_options["num_cpus"]) == ("CacheBlendFront", 1, 0)
    assert (engine.name, engine.num_replicas, engine.ray_actor_options["num_cpus"]) == ("CacheBlendEngine", 3, 0.66)
    assert engine.init_args == (config, 1)
    router = engine._deployment_config.request_router_config
    assert router.request_router_class.endswith("router.ChunkAffinityRouter")
    assert router.request_router_kwargs == {"spill_threshold": 5}
    scaled = build_application(config, ReplicaOptions(replicas=2, min_replicas=1, max_replicas=4, router="default"),
                               local=False)._bound_deployment.init_args[0]._bound_deployment
    assert scaled._deployment_config.autoscaling_config.max_replicas == 4
    assert "ChunkAffinityRouter" not in scaled._deployment_config.request_router_config.request_router_class
    assert not ray.is_initialized()
