"""The ``feather`` command tree: new names, hidden aliases of the old ones, one help text per
group, and flags that mean the same in every command."""

from __future__ import annotations

import pytest

from feather_cli.main import GROUPS, build_parser, main
from feather_cli.options import parse_workloads, split_workload

#: Every command the tree defines, as users type it.
COMMANDS = ("train", "export CHECKPOINT -o p.onnx", "bench serve --policies feather-rule", "bench hybrid",
            "bench loop --run R -o OUT", "bench cht", "bench placement", "bench env", "bench policy --policies p.onnx",
            "bench headroom", "sim compare --workload prefix-groups", "sim validate", "trace stats SPEC",
            "trace gen prefix-groups -o t.jsonl", "profile run -o p.json", "profile fit cpu",
            "profile analytic --gpu h100 -o p.json", "profile prefill -o p.json",
            "profile refit --from-logs L --profile cpu -o p.json", "placement eval --workload prefix-groups",
            "hybrid build", "hybrid check", "replay eval")
#: Old name -> new name: the hidden aliases kept for one release, and the `--load` spelling (argparse's
#: prefix of `--loads`).
ALIASES = {"serve bench --policy feather-rule": "bench serve --policies feather-rule",
           "serve bench --load 1.1,0.9,0.7": "bench serve --loads 1.1,0.9,0.7",
           "serve hybrid-bench": "bench hybrid", "serve loop --run R --output OUT": "bench loop --run R -o OUT",
           "bench policy --policy p.onnx": "bench policy --policies p.onnx",
           "profile prefill --out p.json": "profile prefill -o p.json"}


def test_a_group_module_alone_builds_only_its_commands(capsys):
    """What ``python -m feather_cli.profile`` builds: the profile group's commands and no other."""
    parser = build_parser(("profile",))
    assert callable(parser.parse_args(["profile", "fit", "cpu"]).func)
    with pytest.raises(SystemExit):
        parser.parse_args(["sim", "compare", "--workload", "prefix-groups"])
    assert "invalid choice: 'sim'" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_parses(command):
    args = build_parser().parse_args(command.split())
    assert callable(args.func)


@pytest.mark.parametrize("old,new", ALIASES.items())
def test_old_names_parse_as_the_new_ones(old, new):
    parser = build_parser()
    old_args, new_args = vars(parser.parse_args(old.split())), vars(parser.parse_args(new.split()))
    deprecated = old_args.pop("deprecated", None)
    old_args.pop("group"), new_args.pop("group")
    old_args.pop("command", None), new_args.pop("command", None)
    new_args.pop("deprecated", None)
    assert old_args == new_args
    if old.split()[0] == "serve":
        assert deprecated == (" ".join(old.split()[:2]), " ".join(new.split()[:2]))


def test_an_old_name_warns_that_it_is_deprecated(capsys):
    assert main(["serve", "bench", "--policy", "missing.onnx", "--workload", "prefix-groups"]) == 2
    err = capsys.readouterr().err
    assert "'serve bench' is deprecated" in err and "'bench serve'" in err
    assert "feather: error:" in err                       # the missing policy, before any engine starts


def test_each_group_has_one_help_text(capsys):
    for group, help_text in GROUPS.items():
        with pytest.raises(SystemExit):
            build_parser().parse_args([group, "--help"])
        assert help_text in " ".join(capsys.readouterr().out.split())


def test_workload_flag_takes_a_name_or_a_bare_spec():
    assert split_workload("heavy=prefix-groups:num_groups=4") == ("heavy", "prefix-groups:num_groups=4")
    assert split_workload("prefix-groups:num_groups=4") == ("prefix-groups", "prefix-groups:num_groups=4")
    assert split_workload("runs/my-trace.jsonl@0.7-1") == ("my-trace@0.7-1", "runs/my-trace.jsonl@0.7-1")
    assert split_workload("mooncake@load=0.9") == ("mooncake@load=0.9", "mooncake@load=0.9")   # a load, not a name
    assert split_workload("busy=mooncake@load=0.9") == ("busy", "mooncake@load=0.9")
    assert parse_workloads(["a=mooncake", "no-sharing"]) == {"a": "mooncake", "no-sharing": "no-sharing"}
    assert parse_workloads(["prefix-groups:groups=2", "prefix-groups:groups=3"]) == {
        "prefix-groups#1": "prefix-groups:groups=2", "prefix-groups#2": "prefix-groups:groups=3"}
    assert parse_workloads(None) is None


def test_commands_that_take_one_policy_refuse_several(capsys):
    assert main(["bench", "policy", "--policies", "a.onnx,b.onnx"]) == 2
    assert "takes one policy" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("feather-gym ")


def test_the_installed_commands_point_at_the_cli_layer():
    """``pyproject.toml``'s scripts name importable ``main`` functions of :mod:`feather_cli`."""
    import importlib
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"feather", "feather-train"}
    for target in scripts.values():
        module, _, name = target.partition(":")
        assert module.startswith("feather_cli.") and callable(getattr(importlib.import_module(module), name))
