"""The subcommands of `harts-planner`, one module per group, and the parser that names them.

* :mod:`~harts_planner.commands.parser`: :func:`~harts_planner.commands.parser.build_parser`, the
  subcommands and their options (the subcommands' list: ``DESCRIPTION``, ``harts-planner --help``);
* :mod:`~harts_planner.commands.arg_types`: the argparse types that check each option value where it
  is given;
* :mod:`~harts_planner.commands.synthetic`: ``demo`` and ``synth`` (synthetic rollout steps);
* :mod:`~harts_planner.commands.planning`: ``plan`` and ``show`` (plan a saved batch, in-process or
  on a sidecar; print it or render it);
* :mod:`~harts_planner.commands.sidecar`: ``serve`` and ``bench`` (run the gRPC sidecar; planning
  latency in-process and over gRPC).

The entry point that parses and runs them is :mod:`harts_planner.cli` (``harts-planner``).
"""
