"""What compiles, loads or autotunes while a block of GPU work runs, and how long it takes.

``with CompileTrace() as trace: ...`` records, until the block ends:

* ``triton_compile``: every in-memory miss of a Triton kernel (``JITFunction._do_compile``): a
  compile, or a load from Triton's on-disk cache when ``TRITON_CACHE_DIR`` holds it. The event's
  ``key`` is the kernel's specialization (argument types, divisibility, constexpr values): a kernel
  that misses again on a new shape shows here with the key that changed.
* ``autotune``: every Triton autotuner call whose tuning key was not yet in its cache (it benchmarks
  the candidates, or with ``use_first_config_only`` takes the first one), with the key values.
  Its compiles are also listed as ``triton_compile`` events (the seconds nest).
* ``cute_compile``: FlashAttention-4's CuTe-DSL compiles (``cutlass.cute.compile``) when it is
  installed.
* ``cute_load``: FlashAttention-4 kernels looked up in its persistent cache
  (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``): ``key`` says ``hit`` (loaded from disk) or ``miss``.
* ``torch_compile``: graphs compiled by ``torch.compile`` (dynamo's ``unique_graphs`` counter).

Only the benchmarks use it; it patches class attributes for the block and restores them after.
"""

from __future__ import annotations

import time
from collections import defaultdict


def _short(obj, limit: int = 240) -> str:
    s = repr(obj)
    return s if len(s) <= limit else s[: limit - 3] + "..."


class CompileTrace:
    """Records compile / autotune events inside a ``with`` block (see the module docstring)."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._undo: list = []
        self._graphs0 = None
        self.wall_s = 0.0

    # -------------------------------------------------------------- patching
    def _patch(self, owner, name: str, make) -> None:
        old = getattr(owner, name, None)
        if old is None:
            return
        setattr(owner, name, make(old))
        self._undo.append((owner, name, old))

    def __enter__(self) -> CompileTrace:
        self._t0 = time.perf_counter()
        events = self.events
        try:
            from triton.runtime.autotuner import Autotuner
            from triton.runtime.jit import JITFunction
        except ImportError:  # no Triton: nothing of it to trace
            Autotuner = JITFunction = None
        if JITFunction is not None:

            def make_compile(old):
                def traced(fn_self, key, *args, **kwargs):
                    t = time.perf_counter()
                    out = old(fn_self, key, *args, **kwargs)
                    events.append(
                        {
                            "kind": "triton_compile",
                            "name": getattr(fn_self.fn, "__qualname__", str(fn_self)),
                            "seconds": time.perf_counter() - t,
                            "key": _short(key),
                            "key_id": hash(repr(key)),  # distinct keys counted on the whole key
                        }
                    )
                    return out

                return traced

            self._patch(JITFunction, "_do_compile", make_compile)
        if Autotuner is not None:

            def make_run(old):
                def traced(tuner, *args, **kwargs):
                    before = len(tuner.cache)
                    t = time.perf_counter()
                    out = old(tuner, *args, **kwargs)
                    if len(tuner.cache) > before:
                        new = [k for k in tuner.cache if k not in getattr(tuner, "_trace_seen", set())]
                        tuner._trace_seen = set(tuner.cache)
                        fn = getattr(tuner, "base_fn", None) or getattr(tuner, "fn", None)
                        events.append(
                            {
                                "kind": "autotune",
                                "name": getattr(fn, "__qualname__", getattr(fn, "__name__", str(fn))),
                                "seconds": time.perf_counter() - t,
                                "key": _short(
                                    dict(zip(getattr(tuner, "keys", []), new[-1])) if new else None
                                ),
                                "configs": len(getattr(tuner, "configs", [])),
                            }
                        )
                    return out

                return traced

            self._patch(Autotuner, "run", make_run)
        try:
            import cutlass.cute as cute
        except Exception:  # noqa: BLE001 - FA4 is optional
            cute = None
        if cute is not None:

            def make_cute(old):
                def traced(*args, **kwargs):
                    t = time.perf_counter()
                    out = old(*args, **kwargs)
                    fn = args[0] if args else None
                    events.append(
                        {
                            "kind": "cute_compile",
                            "name": getattr(fn, "__qualname__", type(fn).__name__),
                            "seconds": time.perf_counter() - t,
                            "key": "",
                        }
                    )
                    return out

                return traced

            self._patch(cute, "compile", make_cute)
        try:
            import importlib.util

            fa_cache = None
            if importlib.util.find_spec("flash_attn.cute") is not None:  # FA4 installed: the runtime uses it
                from flash_attn.cute import cache_utils as fa_cache
        except Exception:  # noqa: BLE001 - FA4 is optional
            fa_cache = None
        if fa_cache is not None and hasattr(fa_cache, "JITPersistentCache"):

            def make_load(old):
                def traced(cache, key, *args, **kwargs):
                    t = time.perf_counter()
                    hit = old(cache, key, *args, **kwargs)
                    events.append(
                        {
                            "kind": "cute_load",
                            "name": getattr(cache, "cache_path", None) and cache.cache_path.name or "fa4",
                            "seconds": time.perf_counter() - t,
                            "key": "hit" if hit else "miss",
                        }
                    )
                    return hit

                return traced

            self._patch(fa_cache.JITPersistentCache, "_try_load_from_storage", make_load)
        self._graphs0 = self._graphs()
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            owner, name, old = self._undo.pop()
            setattr(owner, name, old)
        graphs = self._graphs() - self._graphs0
        if graphs:
            self.events.append(
                {"kind": "torch_compile", "name": "unique_graphs", "seconds": 0.0, "key": str(graphs)}
            )
        self.wall_s = time.perf_counter() - self._t0

    @staticmethod
    def _graphs() -> int:
        try:
            from torch._dynamo.utils import counters
        except Exception:  # noqa: BLE001
            return 0
        return int(counters["stats"].get("unique_graphs", 0))

    # -------------------------------------------------------------- report
    def summary(self, top: int = 25) -> dict:
        """Counts and seconds per kind, and per (kind, kernel) the most expensive ``top`` with their
        number of distinct keys and one sample key. Autotune seconds contain their compiles."""
        kinds: dict = defaultdict(lambda: {"count": 0, "seconds": 0.0})
        per: dict = {}
        for e in self.events:
            k = kinds[e["kind"]]
            k["count"] += 1
            k["seconds"] += e["seconds"]
            p = per.setdefault(
                (e["kind"], e["name"]),
                {"kind": e["kind"], "name": e["name"], "count": 0, "seconds": 0.0, "keys": set()},
            )
            p["count"] += 1
            p["seconds"] += e["seconds"]
            p["keys"].add((e.get("key_id", e["key"]), e["key"]))
        rows = sorted(per.values(), key=lambda p: -p["seconds"])[:top]
        for p in rows:
            keys = sorted(p.pop("keys"), key=lambda k: k[1])
            p["distinct_keys"] = len(keys)
            p["sample_keys"] = [k[1] for k in keys[:3]]
        return {"wall_s": self.wall_s, "kinds": dict(kinds), "top": rows}
