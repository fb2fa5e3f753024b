"""trainer.config and the feather-train CLI: settings precedence and clear errors before Ray starts."""

from __future__ import annotations

import pytest

from feather_cli.train import build_train_parser, main, train_flags
from feather_gym.costmodel import hardware_profile
from feather_gym.policies import DEFAULT_MAX_WAIT_STEPS
from trainer.config import DEFAULT_MIXES, TrainConfig, build_config, load_config_file


def flags(argv: list[str]) -> dict:
    return train_flags(build_train_parser().parse_args(argv))


def test_every_setting_is_a_flag_with_help():
    """TrainConfig is the one definition of the settings: each field has help text and a flag, its
    name with dashes except the few spelled as they always were."""
    import dataclasses

    spelled = {"workloads": ["--workload"], "time_budget_s": ["--time-budget"], "num_env_runners": ["--env-runners"],
               "output_dir": ["-o", "--output"]}
    options = {action.dest: action.option_strings for action in build_train_parser()._actions}
    for field in dataclasses.fields(TrainConfig):
        assert field.metadata["help"].strip(), field.name
        assert options[field.name] == spelled.get(field.name, ["--" + field.name.replace("_", "-")])
    assert set(options) == ({f.name for f in dataclasses.fields(TrainConfig)}
                            | {"help", "version", "config", "json", "old_command"})


def test_the_flags_keep_their_spelling():
    config = build_config({}, flags(["--workload", "no-sharing", "--workload", "tool-agent", "--time-budget", "60",
                                     "--env-runners", "0", "--output", "out", "--hidden-sizes", "32", "32",
                                     "--eval-seeds", "7", "8"]))
    assert config.workloads == ("no-sharing", "tool-agent") and config.time_budget_s == 60.0
    assert config.num_env_runners == 0 and str(config.output_dir) == "out"
    assert config.hidden_sizes == (32, 32) and config.eval_seeds == (7, 8)
    with pytest.raises(SystemExit):
        flags(["--iterations", "3", "--time-budget", "60"])          # one budget or the other


def test_ppo_flags_reach_the_ppo_config():
    from trainer.train import ppo_config

    ppo = ppo_config(build_config({"workloads": ["no-sharing"]}, flags(["--lr", "1e-4", "--entropy-coeff", "0.02"])))
    assert ppo.lr == 1e-4 and ppo.entropy_coeff == 0.02
    assert ppo_config(TrainConfig(workloads=("no-sharing",))).lr == TrainConfig().lr


def test_trainer_modules_import_no_cycle():
    """Imports between trainer's modules (inside functions too) form no cycle."""
    import ast
    from graphlib import TopologicalSorter
    from pathlib import Path

    import trainer

    graph = {}
    for path in Path(trainer.__file__).parent.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            imported |= {name.split(".")[1] for name in names if name.startswith("trainer.")}
        graph[path.stem] = imported
    tuple(TopologicalSorter(graph).static_order())          # graphlib.CycleError on a cycle


def test_defaults_mix_sharing_and_no_sharing():
    config = build_config({}, flags([]))
    assert config == TrainConfig()
    resolved = config.resolved()
    assert resolved.profile == hardware_profile() and resolved.output_dir is not None
    assert any(spec.startswith("no-sharing") for spec in resolved.workloads)
    assert any(spec.startswith(("prefix-groups", "tool-agent", "long-doc-qa")) for spec in resolved.workloads)


@pytest.mark.parametrize("profile, device", [("vllm-cpu", "cpu"), ("h200", "cuda")])
def test_the_built_in_mix_follows_the_profiles_device(profile, device):
    from traces.workload import missing_shared_trace

    resolved = TrainConfig(profile=profile).resolved()
    # the mix as built in, less a shared trace this checkout lacks (a clone without ../shared)
    assert resolved.workloads == tuple(spec for spec in DEFAULT_MIXES[device].workloads
                                       if not missing_shared_trace(spec))
    assert resolved.kv_capacity_tokens == DEFAULT_MIXES[device].kv_capacity_tokens
    assert resolved.engine().kv_capacity_tokens == resolved.kv_capacity_tokens
    assert resolved.workload_instances == DEFAULT_MIXES[device].workload_instances
    given = TrainConfig(profile=profile, workloads=("no-sharing",)).resolved()
    assert given.workloads == ("no-sharing",) and given.kv_capacity_tokens is None   # the profile's KV
    assert given.workload_instances == 1


def test_the_cpu_mix_has_every_generators_shape_at_every_load_and_the_time_split_mooncake_trace():
    from traces import GENERATOR_KINDS
    from traces.workload import CPU_ENGINE_WORKLOADS, split_spec
    from trainer.config import CPU_MOONCAKE, MIX_LOADS

    mix = DEFAULT_MIXES["cpu"].workloads
    kinds = {spec.partition(":")[0] for spec in mix if spec.partition(":")[0] in GENERATOR_KINDS}
    assert kinds == set(GENERATOR_KINDS)
    assert min(MIX_LOADS) <= 0.6 and max(MIX_LOADS) >= 1.3
    for spec in (*CPU_ENGINE_WORKLOADS, CPU_MOONCAKE):
        assert {f"{spec}@load={load:g}" for load in MIX_LOADS} <= set(mix)
    assert set(CPU_ENGINE_WORKLOADS) <= set(mix)                                  # and the bursts, as before
    train, held_out = (split_spec(f"{CPU_MOONCAKE}@load=0.9", part) for part in ("train", "eval"))
    assert (train, held_out) == ("mooncake@0-0.07@load=0.9", "mooncake@0.07-0.1@load=0.9")
    described = DEFAULT_MIXES["cpu"].describe()                                   # --help and the run's first line
    assert "multi-turn at own rate, load 0.6, load 0.9, load 1.3" in described
    assert described.endswith("; mooncake@0-0.1 at load 0.6, load 0.9, load 1.3")


def test_a_missing_shared_trace_is_left_out_of_the_built_in_mix(monkeypatch, tmp_path):
    from trainer.config import profile_mix

    monkeypatch.setenv("FEATHER_SHARED_DIR", str(tmp_path))
    mix = profile_mix("vllm-cpu").workloads
    assert mix and not any("mooncake" in spec for spec in mix)
    assert set(mix) == {spec for spec in DEFAULT_MIXES["cpu"].workloads if "mooncake" not in spec}


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "workloads: [no-sharing, 'prefix-groups:groups=3']\niterations: 4\nseed: 7\nhidden_sizes: [32, 32]\n"),
    (".toml", "workloads = ['no-sharing', 'prefix-groups:groups=3']\n"
     "iterations = 4\nseed = 7\nhidden_sizes = [32, 32]\n"),
])
def test_config_file_then_flags(tmp_path, suffix, text):
    path = tmp_path / f"train{suffix}"
    path.write_text(text)
    config = build_config(load_config_file(path), flags(["--seed", "9", "--output", str(tmp_path / "out")]))
    assert config.workloads == ("no-sharing", "prefix-groups:groups=3")
    assert config.iterations == 4 and config.seed == 9 and config.hidden_sizes == (32, 32)
    assert config.output_dir == tmp_path / "out"


def test_config_file_errors_name_the_file_and_setting(tmp_path):
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("iteratoins: 3\n")
    with pytest.raises(ValueError, match=r"a\.yaml: unknown setting\(s\) iteratoins; valid: workloads"):
        load_config_file(bad_key)
    bad_type = tmp_path / "b.toml"
    bad_type.write_text("iterations = 'many'\n")
    with pytest.raises(ValueError, match=r"b\.toml: iterations must be an integer"):
        load_config_file(bad_type)
    with pytest.raises(ValueError, match="must end in .yaml, .yml or .toml"):
        load_config_file(tmp_path / "c.json")


@pytest.mark.parametrize("argv,message", [
    (["--workload", "prefix-grups"], "unknown workload 'prefix-grups'"),
    (["--workload", "prefix-groups:groupz=3"], "valid keys"),
    (["--profile", "tpu-v9"], "no profile 'tpu-v9'"),
    (["--profile", "/nonexistent/profile.json"], "profile.json"),
    (["--iterations", "0"], "argument --iterations: must be >= 1"),
    (["--resume", "/nonexistent/checkpoint"], "checkpoint directory /nonexistent/checkpoint does not exist"),
    (["--warm-start", "fifo"], "argument --warm-start: 'fifo' is not a baseline"),
    (["--max-wait-steps", "-1"], "argument --max-wait-steps: must be >= 0, got -1"),
])
def test_bad_input_fails_fast_with_a_clear_error(tmp_path, capsys, argv, message):
    assert main(argv + ["--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("feather-train: error: ") and message in err
    assert not (tmp_path / "out").exists()          # nothing started, nothing written


@pytest.mark.parametrize("settings,message", [
    ({"workload_instances": 0}, "workload_instances: must be >= 1 and <= 1000"),
    ({"clone_smoothing": 1.0}, "clone_smoothing: must be >= 0 and < 1"),
    ({"improve_warm_start": -0.1}, "improve_warm_start: must be >= 0"),
])
def test_bad_training_settings_name_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(workloads=("no-sharing",), **settings).validate()


def test_resume_from_a_corrupted_checkpoint_fails_before_training(tmp_path, capsys):
    checkpoint = tmp_path / "checkpoint"
    (checkpoint / "learner_group" / "learner" / "rl_module" / "default_policy").mkdir(parents=True)
    module = checkpoint / "learner_group" / "learner" / "rl_module" / "default_policy"
    (module / "class_and_ctor_args.pkl").write_bytes(b"\x80\x05trunc")
    assert main(["--resume", str(checkpoint), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "feather-train: error: checkpoint" in err and "not a readable RLlib checkpoint" in err
    assert not (tmp_path / "out").exists()


def test_export_needs_checkpoint_and_output(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export"])
    assert exit_info.value.code == 2 and "checkpoint" in capsys.readouterr().err


# ---- held out means unseen: seed sets and trace splits --------------------------------------

SMALL = ("no-sharing:num_requests=5",)


@pytest.mark.parametrize("settings, first, second, seed", [
    ({"seed": 9_001}, "training env seeds", "eval_seeds", 10_001),                  # 9_001 + 1000 x runner 1
    ({"seed": 19_002}, "training env seeds", "validation_seeds", 20_002),
    ({"seed": 49_003}, "training env seeds", "warm-start demonstration seeds", 50_003),
    ({"seed": 0, "num_env_runners": 3, "eval_seeds": (3_000,)}, "training env seeds", "eval_seeds", 3_000),
    ({"seed": 7, "num_env_runners": 0, "validation_seeds": (7,)}, "training env seeds", "validation_seeds", 7),
    ({"validation_seeds": (50_001,)}, "warm-start demonstration seeds", "validation_seeds", 50_001),
    ({"eval_seeds": (50_000, 10_001)}, "warm-start demonstration seeds", "eval_seeds", 50_000),
    ({"eval_seeds": (1, 2), "validation_seeds": (2, 3)}, "validation_seeds", "eval_seeds", 2),
])
def test_overlapping_seed_sets_are_refused_naming_both_and_a_shared_seed(settings, first, second, seed):
    config = TrainConfig(workloads=SMALL, **settings)
    with pytest.raises(ValueError, match="pairwise disjoint") as error:
        config.validate()
    assert str(error.value).startswith(f"{first}") and f" and {second} share seed {seed}:" in str(error.value)


def test_seed_sets_follow_the_env_runners_and_the_warm_start():
    config = TrainConfig(workloads=SMALL, seed=5, num_env_runners=2)
    sets = config.seed_sets()
    assert sets["training env seeds (seed + 1000 x env runner)"] == (1_005, 2_005)
    several = TrainConfig(workloads=SMALL, seed=5, num_env_runners=2, workload_instances=3).seed_sets()
    assert several["training env seeds (seed + 1000 x env runner)"] == (1_005, 1_006, 1_007, 2_005, 2_006, 2_007)
    # The playout-improved warm start (the default) records 8 seeds; the flag sets its gain or turns it off.
    assert sets["warm-start demonstration seeds"] == tuple(range(50_000, 50_008))
    improved = build_config({"workloads": list(SMALL)}, flags(["--improve-warm-start", "0.02"]))
    assert improved.improve_warm_start == 0.02
    plain = build_config({"workloads": list(SMALL), "improve_warm_start": 0.02}, flags(["--improve-warm-start", "off"]))
    assert plain.improve_warm_start is None
    assert plain.seed_sets()["warm-start demonstration seeds"] == (50_000, 50_001, 50_002, 50_003)
    with pytest.raises(SystemExit):
        flags(["--improve-warm-start", "some"])
    assert TrainConfig(num_env_runners=0, seed=5).training_env_seeds() == (5,)     # the local runner's envs
    # Without a warm start (or when resuming) no demonstrations are recorded: their seeds are free.
    TrainConfig(workloads=SMALL, warm_start="none", validation_seeds=(50_001,)).validate()
    TrainConfig().validate()                                                    # the defaults are disjoint


def test_training_env_seeds_are_the_seeds_the_env_creator_uses():
    from ray.rllib.env.env_context import EnvContext

    from trainer.train import env_config, make_training_env

    config = TrainConfig(workloads=SMALL, seed=3, num_env_runners=2)
    seeds = [make_training_env(EnvContext(env_config(config), worker_index=w)).unwrapped.config["seed"]
             for w in (1, 2)]
    assert tuple(seeds) == config.training_env_seeds()


def test_trace_files_train_on_the_earlier_part_and_evaluate_on_the_later(tmp_path):
    import traces
    from trainer.train import env_config

    path = tmp_path / "recorded.jsonl"
    traces.write_trace(traces.resolve_workload("no-sharing:num_requests=40"), path)
    config = TrainConfig(workloads=(str(path), "prefix-groups"), eval_fraction=0.25)
    config.validate()
    assert config.training_workloads() == (f"{path}@0-0.75", "prefix-groups")
    assert config.evaluation_workloads() == (f"{path}@0.75-1", "prefix-groups")
    assert env_config(config)["workloads"] == list(config.training_workloads())   # training, warm start


@pytest.mark.parametrize("argv, message", [
    (["--eval-fraction", "1.5"], "argument --eval-fraction: must be > 0 and < 1, got 1.5"),
    (["--seed", "9001"], "training env seeds (seed + 1000 x env runner) and eval_seeds share seed 10001"),
])
def test_split_settings_fail_fast_on_the_command_line(tmp_path, capsys, argv, message):
    assert main(argv + ["--workload", SMALL[0], "--profile", "cpu", "--output", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_the_waiting_time_bound_trains_validates_and_evaluates_alike():
    """One bound for the env, validation and held-out evaluation: what the policy is served with."""
    from trainer.train import env_config

    config = TrainConfig(workloads=("no-sharing",), max_wait_steps=8)
    assert config.engine().max_wait_steps == 8 and env_config(config)["max_wait_steps"] == 8
    assert TrainConfig().max_wait_steps == DEFAULT_MAX_WAIT_STEPS
