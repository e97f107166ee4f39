"""HARTS runtime: compact-layout execution of hybrid-attention models in PyTorch.

Requires the ``runtime`` extra (torch). Nothing in :mod:`harts_planner` imports it.
"""
