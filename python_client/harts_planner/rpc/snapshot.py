"""Descriptor snapshot of ``planner.proto``: what must not change within ``harts.planner.v1``.

The snapshot (``proto/harts/planner/v1/planner.snapshot.json``, committed) records, from the built
descriptor (``harts_planner.rpc.planner_pb2``):

* every message, nested ones (map entries) included, by full name: each field (by number) with its ``number``,
  ``type`` (``int64``, ``bytes``, ``message``, ...), ``label`` (``optional`` / ``repeated``), and
  where they apply ``type_name`` (of a message or enum field), ``oneof`` and ``proto3_optional``;
* every enum: its values' numbers;
* every service: each method's input and output types, and whether either side streams.

:func:`compare` splits the differences between a snapshot and the current descriptor into
*breaking* ones (an entry removed, or its number, type, label, oneof or presence changed: never
allowed within a version) and *additions* (a new message, field, enum value or method: allowed, but
the snapshot must be regenerated and committed with them). Regenerate from the repository root with::

    python -m harts_planner.rpc.snapshot proto/harts/planner/v1/planner.snapshot.json

(``--check`` compares instead of writing, and exits 1 on any difference). The descriptor is the one
built from the ``.proto`` at install time: re-run ``pip install -e .`` after editing it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

#: Path of the committed snapshot, relative to the repository root.
SNAPSHOT_PATH = "proto/harts/planner/v1/planner.snapshot.json"
#: The command that regenerates it (run from the repository root).
REGENERATE = f"python -m harts_planner.rpc.snapshot {SNAPSHOT_PATH}"

_FIELD = descriptor_pb2.FieldDescriptorProto


def _field_entry(field: descriptor_pb2.FieldDescriptorProto, oneofs: list[str]) -> dict:
    entry = {
        "number": field.number,
        "type": _FIELD.Type.Name(field.type).removeprefix("TYPE_").lower(),
        "label": _FIELD.Label.Name(field.label).removeprefix("LABEL_").lower(),
    }
    if field.type_name:
        entry["type_name"] = field.type_name.lstrip(".")
    if field.proto3_optional:
        entry["proto3_optional"] = True
    elif field.HasField("oneof_index"):
        entry["oneof"] = oneofs[field.oneof_index]
    return entry


def _messages(prefix: str, messages, out: dict, enums: dict) -> None:
    for msg in messages:
        name = f"{prefix}.{msg.name}"
        oneofs = [o.name for o in msg.oneof_decl]
        out[name] = {f.name: _field_entry(f, oneofs) for f in sorted(msg.field, key=lambda f: f.number)}
        _messages(name, msg.nested_type, out, enums)
        _enums(name, msg.enum_type, enums)


def _enums(prefix: str, enums, out: dict) -> None:
    for enum in enums:
        out[f"{prefix}.{enum.name}"] = {v.name: v.number for v in enum.value}


def _method_entry(method: descriptor_pb2.MethodDescriptorProto) -> dict:
    """Input and output types, and which side streams (recorded only when it does: a unary method's
    entry is its two types)."""
    entry: dict[str, str | bool] = {
        "input": method.input_type.lstrip("."),
        "output": method.output_type.lstrip("."),
    }
    if method.client_streaming:
        entry["client_streaming"] = True
    if method.server_streaming:
        entry["server_streaming"] = True
    return entry


def snapshot(file_descriptor=None) -> dict:
    """The snapshot of a file descriptor (default: ``planner_pb2.DESCRIPTOR``) as a JSON-able dict."""
    if file_descriptor is None:
        from harts_planner.rpc import planner_pb2

        file_descriptor = planner_pb2.DESCRIPTOR
    proto = descriptor_pb2.FileDescriptorProto()
    file_descriptor.CopyToProto(proto)
    messages: dict = {}
    enums: dict = {}
    _messages(proto.package, proto.message_type, messages, enums)
    _enums(proto.package, proto.enum_type, enums)
    services = {
        f"{proto.package}.{s.name}": {m.name: _method_entry(m) for m in s.method} for s in proto.service
    }
    return {
        "file": proto.name,
        "package": proto.package,
        "messages": dict(sorted(messages.items())),
        "enums": dict(sorted(enums.items())),
        "services": services,
    }


def compare(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """``(breaking, additions)``: human-readable differences from snapshot ``old`` to ``new``."""
    breaking: list[str] = []
    additions: list[str] = []
    if old.get("package") != new.get("package"):
        breaking.append(f"package changed from {old.get('package')} to {new.get('package')}")
    for kind, key in (("message", "messages"), ("enum", "enums"), ("service", "services")):
        before, after = old.get(key, {}), new.get(key, {})
        for name in before:
            if name not in after:
                breaking.append(f"{kind} {name} was removed")
        for name in after:
            if name not in before:
                additions.append(f"{kind} {name} is new")
        for name in before.keys() & after.keys():
            b, a = before[name], after[name]
            what = {"message": "field", "enum": "value", "service": "method"}[kind]
            for member, entry in b.items():
                if member not in a:
                    breaking.append(f"{what} {name}.{member} ({entry}) was removed")
                elif a[member] != entry:
                    breaking.append(f"{what} {name}.{member} changed from {entry} to {a[member]}")
            for member in a.keys() - b.keys():
                additions.append(f"{what} {name}.{member} ({a[member]}) is new")
    return sorted(breaking), sorted(additions)


def _dump(obj, depth: int) -> str:
    if not isinstance(obj, dict) or depth == 3:
        return json.dumps(obj, separators=(", ", ": "))
    pad = "  " * (depth + 1)
    items = [f"{pad}{json.dumps(k)}: {_dump(v, depth + 1)}" for k, v in obj.items()]
    return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}" if items else "{}"


def dumps(snap: dict) -> str:
    """The snapshot as committed: JSON, one line per field, enum value or method."""
    return _dump(snap, 0) + "\n"


def main(argv=None) -> int:
    """``python -m harts_planner.rpc.snapshot PATH [--check]``: write (or check) the snapshot."""
    ap = argparse.ArgumentParser(
        prog="python -m harts_planner.rpc.snapshot", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument(
        "path", nargs="?", default=SNAPSHOT_PATH, help=f"snapshot file (default: {SNAPSHOT_PATH})"
    )
    ap.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = ap.parse_args(argv)
    current = snapshot()
    path = Path(args.path)
    if not args.check:
        path.write_text(dumps(current))
        print(f"wrote {path}")
        return 0
    breaking, additions = compare(json.loads(path.read_text()), current)
    for line in breaking:
        print(f"breaking: {line}")
    for line in additions:
        print(f"new (regenerate the snapshot: {REGENERATE}): {line}")
    return 1 if breaking or additions else 0


if __name__ == "__main__":
    sys.exit(main())
