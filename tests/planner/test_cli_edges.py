"""Every `harts-planner` error is one line on stderr and a non-zero exit code, never a traceback
(issue 17): option values checked where they are given, ports, hosts, files, an unreachable sidecar,
deeply nested JSON, a closed stdout. Most cases run ``main`` in-process; the ones about the process
itself (a bound port, a closed pipe) run ``python -m harts_planner.cli``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from harts_planner import cli


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny.hrb"
    assert cli.main(["synth", str(path), "--preset", "tiny", "--quiet"]) == 0
    return path


def _one_line_error(capsys, code: int, argv: list[str], *fragments: str) -> str:
    got = cli.main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert got == code, (argv, got, captured.err)
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert "error:" in lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


BAD_VALUES = [  # (argv, fragments): refused by the parser before any work (exit 2)
    (["serve", "--port", "-1"], ["--port", "must be in [0, 65535], got -1"]),
    (["serve", "--port", "65536"], ["--port", "got 65536"]),
    (["serve", "--port", "70000"], ["--port", "got 70000"]),
    (["serve", "--port", "http"], ["--port", "must be an integer"]),
    (["serve", "--workers", "0"], ["--workers", "must be in [1, 1024]"]),
    (["serve", "--grace", "-1"], ["--grace"]),
    (["serve", "--grace", "nan"], ["--grace"]),
    (["serve", "--max-message-mb", "4096"], ["--max-message-mb", "[1, 2047]"]),
    (["serve", "--max-rows", "0"], ["--max-rows"]),
    (["serve", "--max-queued", "-1"], ["--max-queued"]),
    (["serve", "--host", "a b"], ["--host"]),
    (["plan", "{tiny}", "--dp", "0"], ["--dp", "got 0"]),
    (["plan", "{tiny}", "--dp", str(2**63)], ["--dp", str(2**63)]),
    (["plan", "{tiny}", "--capacity", "-5"], ["--capacity"]),
    (["plan", "{tiny}", "--chunk-size", "0"], ["--chunk-size", "[1, 1048576]"]),
    (["plan", "{tiny}", "--target", "localhost"], ["--target", "HOST:PORT"]),
    (["plan", "{tiny}", "--target", "localhost:0"], ["--target", "[1, 65535]"]),
    (["plan", "nofile.hrb"], ["'nofile.hrb': no such file"]),
    (["plan", "{dir}"], ["is a directory"]),
    (["plan", "{tiny}.txt"], ["must end in .hrb or .jsonl"]),
    (["synth", "out.txt"], ["must end in .hrb or .jsonl"]),
    (["synth", "/no/such/dir/out.hrb"], ["does not exist"]),
    (["synth", "out.hrb", "--seed", "-1"], ["--seed"]),
    (["synth", "out.hrb", "--preset", "nope"], ["--preset", "invalid choice"]),
    (["demo", "--model-steps", "-1"], ["--model-steps"]),
    (["bench", "--clients", "0"], ["--clients"]),
    (["bench", "--json", "/no/such/dir/report.json"], ["--json", "does not exist"]),
    (["show", "{tiny}", "-o", "/no/such/dir/x.html"], ["does not exist"]),
    (["show", "{tiny}", "--max-segments", "-2"], ["--max-segments"]),
    ([], ["required"]),
    (["nope"], ["invalid choice"]),
]


@pytest.mark.parametrize("argv,fragments", BAD_VALUES, ids=[" ".join(a) or "none" for a, _ in BAD_VALUES])
def test_bad_option_values_are_one_line_before_any_work(capsys, tmp_path, tiny_file, argv, fragments):
    directory = tmp_path / "x.hrb"
    directory.mkdir()
    argv = [a.format(tiny=tiny_file, dir=directory) for a in argv]
    _one_line_error(capsys, 2, argv, *fragments)
    assert not (tmp_path / "out.hrb").exists()


def test_unreachable_sidecar_is_one_line(capsys, tiny_file):
    _one_line_error(capsys, 1, ["plan", str(tiny_file), "--target", "127.0.0.1:9"], "sidecar unavailable")


def test_deeply_nested_json_is_one_line(capsys, tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100_000 + "\n")
    _one_line_error(capsys, 2, ["plan", str(path)], "line 1", "nested too deeply")
    path.write_text('{"tokens": ' + "[" * 50_000 + "]" * 50_000 + "}\n")
    _one_line_error(capsys, 2, ["plan", str(path)], "line 1")


def test_unreadable_and_malformed_files_are_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.hrb"
    bad.write_bytes(b"HARTSRB\0" + b"\0" * 10)
    _one_line_error(capsys, 2, ["plan", str(bad)], "header")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"tokens": [1]}\n\xff\xfe\n')
    _one_line_error(capsys, 2, ["plan", str(binary)], "line 2", "UTF-8")


def test_help_is_not_an_error(capsys):
    assert cli.main(["--help"]) == 0
    assert "usage: harts-planner" in capsys.readouterr().out
    assert cli.main(["serve", "--help"]) == 0
    assert "--max-plan-memory-mb" in capsys.readouterr().out


def _run(*argv: str, timeout: float = 60.0, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harts_planner.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def _assert_one_line(result: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, (result.returncode, result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_a_port_in_use_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _assert_one_line(
            _run("serve", "--port", str(port)), 1, f"cannot bind 127.0.0.1:{port}: Address already in use"
        )


def test_an_address_of_no_interface_is_one_line():
    _assert_one_line(_run("serve", "--host", "192.0.2.1", "--port", "0"), 1, "cannot bind 192.0.2.1:0")
    _assert_one_line(_run("serve", "--host", "no-such-host.invalid", "--port", "0"), 1, "cannot resolve host")


def test_a_closed_stdout_ends_quietly(tmp_path):
    """``plan --json | head -1``: the reader goes away; no traceback, no 'Exception ignored'."""
    path = tmp_path / "medium.hrb"
    assert cli.main(["synth", str(path), "--preset", "medium", "--quiet"]) == 0
    argv = ["plan", str(path), "--call-plans", "--json"]  # 330 KB of JSON, more than a pipe holds
    with subprocess.Popen(
        [sys.executable, "-m", "harts_planner.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        proc.stdout.readline()
        proc.stdout.close()  # as head does after its line
        err = proc.stderr.read().decode()
        code = proc.wait(60)
    assert code == 141 and err == "", (code, err)


@pytest.mark.skipif(os.environ.get("HARTS_TRACEBACK") is not None, reason="tracebacks requested")
def test_an_internal_error_is_one_line(capsys, tiny_file):
    def broken(args):
        raise KeyError("oops")

    parser = cli.build_parser()
    args = parser.parse_args(["plan", str(tiny_file)])
    args.func = broken
    assert cli.run(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error: KeyError" in err and "HARTS_TRACEBACK=1" in err
