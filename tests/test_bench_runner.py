"""The bench runner and how a bench reaches the command line: every bench's result is written,
shown with the machine it was measured on, and its sub-command is declared beside it."""

from __future__ import annotations

import argparse
import json

import pytest

from specforge.bench import BENCHES, commands
from specforge.bench.runner import TEMPERATURE, Report, bench_command, finish, unfinished
from specforge.commands import Subcommand, add_subcommand
from specforge.errors import ConfigError
from specforge.machine import machine


def _result(**more):
    return {"machine": machine(), "rows": [1, 2], **more}


def test_finish_writes_the_json_table_and_files_then_shows_the_machine(tmp_path, capsys):
    report = Report(lambda r: f"r-{len(r['rows'])}.json", lambda r: f"{len(r['rows'])} rows", table_file="table.md",
                    files=lambda r, out: [out / "extra.txt"])
    paths = finish(report, _result(), tmp_path / "out")
    assert [p.name for p in paths] == ["r-2.json", "table.md", "extra.txt"]
    assert json.loads(paths[0].read_text())["rows"] == [1, 2] and paths[1].read_text() == "2 rows\n"
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "2 rows" and out.splitlines()[1].startswith("machine: ")
    assert err.strip() == f"wrote {', '.join(map(str, paths))}"
    finish(report, _result(), tmp_path / "out", as_json=True)
    out, err = capsys.readouterr()
    assert json.loads(out)["rows"] == [1, 2] and err.startswith("machine: ")  # stdout: the JSON alone


def test_only_an_unfinished_run_is_resumed_and_an_unreadable_one_is_not_overwritten(tmp_path):
    path = tmp_path / "serving.json"
    assert unfinished(path, lambda why: ConfigError([why])) is None
    path.write_text(json.dumps({"complete": True}))
    assert unfinished(path, lambda why: ConfigError([why])) is None
    path.write_text(json.dumps({"complete": False, "records": []}))
    assert unfinished(path, lambda why: ConfigError([why])) == {"complete": False, "records": []}
    path.write_text("{half")
    with pytest.raises(ConfigError, match=r"serving.json is unreadable .*give another --out"):
        unfinished(path, lambda why: ConfigError([why]))


def test_a_bench_command_takes_its_help_from_its_measurement(tmp_path, capsys):
    def measure(args):
        """one line of help

        The description, over
        two lines.

        And a second paragraph.
        """
        return None if args.n == 0 else _result(n=args.n)

    def arguments(p):
        p.add_argument("--n", type=int, default=1)
        p.add_argument("--out", default=str(tmp_path))
        p.add_argument("--json", action="store_true")

    command = bench_command("demo", arguments, measure, Report("demo.json", lambda r: "table"),
                            passed=lambda r: r["n"] < 3)
    assert command.help == "one line of help"
    assert command.description == "The description, over two lines.  And a second paragraph."
    sub = argparse.ArgumentParser().add_subparsers()
    parser = add_subcommand(sub, command)
    run = parser.parse_args([]).func
    assert run(parser.parse_args(["--n", "0"])) == 0 and not (tmp_path / "demo.json").exists()  # nothing to show
    assert run(parser.parse_args(["--n", "2"])) == 0 and (tmp_path / "demo.json").is_file()
    assert run(parser.parse_args(["--n", "3"])) == 1  # a check failed
    assert Subcommand.documented("x", arguments, lambda a: 0, "help only").description is None


def test_every_bench_module_declares_its_command_and_decodes_greedily_by_default():
    names = [c.name for c in commands()]
    assert names == ["engine", "ab", "round", "pass", "drafters", "probe", "serving", "vllm-drafter", "llamacpp-drafter",
                     "attention"]
    assert len(BENCHES) == len(names) - 1  # peer_drafter declares two (vllm-drafter, llamacpp-drafter)
    assert all(c.help and c.description for c in commands())
    assert TEMPERATURE == 0.0
