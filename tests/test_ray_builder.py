"""``build_app`` and the ``serve run`` builder: the deployments and settings they produce,
checked without starting Ray (skipped where Ray Serve is not installed)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (the 'ray' extra)")

from async_engine.ray_serve.app import REPLICA_ENV, Autoscaling, build_app  # noqa: E402
from async_engine.ray_serve.builder import app as serve_run_app  # noqa: E402
from async_engine.ray_serve.coalesce import DEFAULT_MESSAGES_PER_S  # noqa: E402


def deployment(application):
    return application._bound_deployment  # Serve keeps the bound deployment here


def test_the_default_layout_is_the_replica_itself_behind_the_proxy() -> None:
    replica = deployment(build_app({"device": "sim", "max_num_seqs": 32}, 2))
    assert replica.name == "EngineReplica"
    assert replica.num_replicas == 2
    assert replica.max_ongoing_requests == 4 * 32  # the engine queues, not Serve's proxy
    assert replica.ray_actor_options["runtime_env"]["env_vars"] == REPLICA_ENV
    assert replica.ray_actor_options["num_cpus"] == 0
    assert replica.logging_config["enable_access_log"] is False
    engine_options, options = replica.init_args
    assert engine_options == {"device": "sim", "max_num_seqs": 32}
    assert options.messages_per_s == DEFAULT_MESSAGES_PER_S


def test_prefix_affinity_puts_an_ingress_before_autoscaled_replicas() -> None:
    ingress = deployment(build_app({"device": "sim"}, Autoscaling(1, 3), "prefix-affinity"))
    assert ingress.name == "EngineIngress"
    replica = deployment(ingress.init_args[0])
    assert replica.name == "EngineDeployment"
    config = replica._deployment_config
    assert (config.autoscaling_config.min_replicas, config.autoscaling_config.max_replicas) == (
        1,
        3,
    )
    assert config.autoscaling_config.target_ongoing_requests == 64.0  # max_num_seqs
    assert config.request_router_config.request_router_class.endswith("PrefixCacheAffinityRouter")


def test_bad_settings_fail_before_anything_is_deployed() -> None:
    with pytest.raises(ValueError, match="router"):
        build_app({"device": "sim"}, 1, "round-robin")
    with pytest.raises(ValueError, match="device"):
        build_app({"device": "tpu"}, 1)


def test_serve_run_arguments_become_engine_and_deployment_settings() -> None:
    replica = deployment(
        serve_run_app({"device": "sim", "max-num-seqs": "16", "overlap": "off", "replicas": "3"})
    )
    assert replica.num_replicas == 3
    assert replica.init_args[0] == {"device": "sim", "max_num_seqs": 16, "overlap": False}
    scaled = deployment(serve_run_app({"device": "sim", "autoscale_max": "4"}))
    assert scaled._deployment_config.autoscaling_config.max_replicas == 4
    paced = deployment(serve_run_app({"device": "sim", "messages_per_s": "0"}))
    assert paced.init_args[1].messages_per_s is None
    with pytest.raises(ValueError, match="unknown arguments replica"):
        serve_run_app({"replica": "2"})
