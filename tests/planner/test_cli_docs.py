"""The README documents the CLI and the sidecar as they are: every `harts-planner` flag appears in
its command's synopsis and every flag of a synopsis exists; the quoted refusal is the server's."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from harts_planner import cli

README = Path(__file__).resolve().parents[2] / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def _synopses() -> dict[str, str]:
    """Command -> its synopsis lines (the first line and its indented continuations)."""
    block = _section("CLI").split("```")[1]
    out: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        m = re.match(r"harts-planner (\w+)", line)
        if m:
            current = m.group(1)
            out[current] = line
        elif current and line.startswith(" "):
            out[current] += " " + line.strip()
    return out


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _options(parser: argparse.ArgumentParser) -> list[tuple[str, ...]]:
    """The option strings of each documented option (``("-o", "--output")``)."""
    return [
        tuple(a.option_strings)
        for a in parser._actions
        if a.option_strings and a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
    ]


def test_every_command_has_a_synopsis():
    assert set(_synopses()) == set(_subparsers())


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_synopsis_lists_every_flag_and_no_other(command):
    synopsis = _synopses()[command].split("#")[0]
    options = _options(_subparsers()[command])
    written = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", synopsis))
    missing = [o for o in options if not written & set(o)]
    assert not missing, (command, missing)  # each option by one of its names
    unknown = written - {name for o in options for name in o}
    assert not unknown, (command, unknown)


def test_the_quoted_refusal_is_the_servers():
    import grpc

    from harts_planner import SegmentTree
    from harts_planner.rpc import codec
    from harts_planner.rpc.server import create_server

    quoted = re.search(r"`(\w+: this request needs about .*?)`", _section("Sidecar").replace("\n  ", " "))
    assert quoted
    request = codec.plan_calls_request(SegmentTree([-1], [2**31 - 1], [0]), None, 64, 4).SerializeToString()
    assert len(request) == 26
    with create_server("127.0.0.1:0", workers=1) as server, grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(
            codec.PLAN_CALLS, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.details() == quoted.group(1)


def test_the_tree_request_size_is_the_readmes():
    """README: the segment-tree request of the swe-like step is 49 KB."""
    from harts_planner import RolloutBatch, synth
    from harts_planner.rpc import codec

    syn = synth.generate("swe-like", seed=0)
    tree = RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids).segment_tree()
    size = len(codec.serialize_plan_step_request(tree, 2, 65536, 64, {}, False, 4))
    assert "49 KB for the 57M-token `swe-like` step" in _section("Sidecar").replace("\n", " ")
    assert round(size / 1000) == 49, size
