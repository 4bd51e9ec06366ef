"""``cacheblend-rag serve --ray`` refuses what cannot work before any Ray starts (exit 2, one line on stderr):
a store of each replica's own, no --store, half of an autoscaling range, a bad count. Ray's start is replaced
here by a failure, and the launcher's ``run`` by a recorder, so nothing of Ray can start in these tests."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("fastapi")
if importlib.util.find_spec("ray") is None:  # found, not imported: serve --ray itself imports it only after its checks
    pytest.skip("serve --ray needs the [ray] extra", allow_module_level=True)
from cacheblend_rag.cli import main as cli_main  # noqa: E402
from cacheblend_rag.server.replicas import launch  # noqa: E402
from cacheblend_rag.server.replicas.local_ray import LocalRay  # noqa: E402


@pytest.fixture
def runs(monkeypatch):
    """The calls that reached the launcher (none may reach a real Ray)."""
    calls: list[tuple] = []

    def no_ray(*args, **kwargs):
        raise AssertionError("a local Ray was started")

    def run(config, options, **kwargs):
        calls.append((config, options, kwargs))
        return 0

    monkeypatch.setattr(LocalRay, "start", no_ray)
    monkeypatch.setattr(launch, "run", run)
    return calls


def serve(capsys, *flags: str) -> tuple[int, str]:
    code = cli_main(["serve", "--model", "tiny-llama", "--ray", *flags])
    return code, capsys.readouterr().err


def test_a_folder_store_for_2_replicas_is_refused(runs, capsys, tmp_path):
    code, err = serve(capsys, "--store", str(tmp_path / "somewhere"), "--replicas", "2")
    assert code == 2 and not runs
    assert "not shared" in err and "redis://" in err
    assert not (tmp_path / "somewhere").exists()  # refused before any store was opened


def test_memory_is_refused_when_autoscaling_may_reach_2(runs, capsys):
    code, err = serve(capsys, "--store", "memory", "--replicas", "1", "--min-replicas", "1", "--max-replicas", "3")
    assert code == 2 and not runs and "3 replicas" in err


def test_ray_needs_a_store(runs, capsys):
    code, err = serve(capsys)
    assert code == 2 and not runs and "--ray needs --store" in err


def test_half_an_autoscaling_range_is_refused(runs, capsys):
    code, err = serve(capsys, "--store", "redis://h/0", "--min-replicas", "1")
    assert code == 2 and not runs and "--min-replicas and --max-replicas" in err


@pytest.mark.parametrize("flags, named", [(("--replicas", "0"), "--replicas 0"),
                                          (("--replica-threads", "0"), "--replica-threads 0"),
                                          (("--replicas", "5", "--min-replicas", "1", "--max-replicas", "3"),
                                           "--replicas 5")])
def test_bad_counts_are_refused_naming_their_flag(runs, capsys, flags, named):
    code, err = serve(capsys, "--store", "redis://h/0", *flags)
    assert code == 2 and not runs and named in err


def test_a_refusal_does_not_show_the_stores_password(runs, capsys):
    code, err = serve(capsys, "--store", "tiered:/p, redis://:secret@h/0", "--replicas", "2")
    assert code == 2 and "secret" not in err and "***" in err


def test_good_flags_reach_the_launcher(runs, capsys):
    code, err = serve(capsys, "--store", "redis://:secret@h/0", "--replicas", "3", "--router", "default",
                      "--replica-threads", "2", "--ray-address", "auto", "--port", "0", "--graceful-shutdown", "7")
    assert code == 0, err
    (config, options, kwargs), = runs
    assert config.store == "redis://:secret@h/0" and config.model == "tiny-llama"
    assert options == launch.ReplicaOptions(replicas=3, router="default", threads=2, ray_address="auto",
                                            graceful_shutdown_s=7)
    assert kwargs["port"] == 0
    code, _ = serve(capsys, "--store", "/nonexistent/kv", "--replicas", "1")  # one replica: its own store is fine
    assert code == 0 and runs[-1][1].replicas == 1
