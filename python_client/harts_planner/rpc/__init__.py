"""The gRPC planner sidecar (``harts.planner.v1.PlannerService``) and its client.

``planner_pb2`` is generated from ``proto/harts/planner/v1/planner.proto`` at build time.
Use :class:`harts_planner.Planner` rather than these modules directly:

* :mod:`harts_planner.rpc.server`: ``create_server``, ``serve``, ``SidecarProcess`` (the entry
  points; the server's other jobs: :mod:`~harts_planner.rpc.interceptor`,
  :mod:`~harts_planner.rpc.ledger`, :mod:`~harts_planner.rpc.request_reader`,
  :mod:`~harts_planner.rpc.admission`, :mod:`~harts_planner.rpc.servicer`,
  :mod:`~harts_planner.rpc.control`, :mod:`~harts_planner.rpc.logs`, :mod:`~harts_planner.rpc.wire`,
  :mod:`~harts_planner.rpc.tls`, :mod:`~harts_planner.rpc.limits`);
* :mod:`harts_planner.rpc.client`: ``SidecarClient``, status codes -> exceptions;
* :mod:`harts_planner.rpc.codec`: plans and requests <-> wire messages;
* :mod:`harts_planner.rpc.status`: planner errors <-> gRPC status codes and google.rpc details;
* :mod:`harts_planner.rpc.snapshot`: the committed descriptor snapshot of ``planner.proto``.
"""
