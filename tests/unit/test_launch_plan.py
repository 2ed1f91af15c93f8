"""The launch plan is complete when created: the request's rank variables and the preload
setting are in it, read once, and the launcher is made from it alone."""

from __future__ import annotations

from nbaccel.launch.launchers.forkserver.launcher import ForkServerLauncher
from nbaccel.launch.plan import LaunchPlan
from nbaccel.launch.request import Front, LaunchRequest


def test_the_plan_holds_the_requests_rank_variables_and_the_fronts_own():
    request = LaunchRequest(cpu=True, num_processes=2, parallelism_config_dp_shard_size=2)
    plan = LaunchPlan.create(Front.LAUNCHER, request, extra_env={"OMP_NUM_THREADS": "1"})
    assert plan.extra_env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "2"
    assert plan.extra_env["OMP_NUM_THREADS"] == "1"
    assert plan.rank_env(1, 29500)["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "2"
    # a pool's cells bring their own (each %%distributed cell's options)
    pool = LaunchPlan.create(Front.MAGIC, request)
    assert "PARALLELISM_CONFIG_DP_SHARD_SIZE" not in pool.extra_env


def test_the_preload_setting_is_read_once_when_the_plan_is_made(monkeypatch):
    monkeypatch.setenv("NBACCEL_PRELOAD", "off")
    plan = LaunchPlan.create(Front.LAUNCHER, LaunchRequest(cpu=True, num_processes=2))
    monkeypatch.setenv("NBACCEL_PRELOAD", "on")  # after the plan: not this launch's
    assert plan.setting is not None and plan.setting.mirror is False
    launcher = plan.make_launcher(["json"])
    assert isinstance(launcher, ForkServerLauncher)
    assert launcher.setting == plan.setting and launcher.preload == ("json",)
    asked = LaunchPlan.create(Front.LAUNCHER, LaunchRequest(cpu=True, preload=["on", "json"]))
    assert asked.setting is not None and asked.setting.mirror is True
    assert asked.setting.add == ("json",)
