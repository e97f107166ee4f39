"""The rollout engine's weight sync: the bucketed stream (``harts_runtime.engine.weights``) against
``export_weights`` (issue 45 item 5). Each case runs ``--repeat`` times, the fastest kept.

For one model (a flavor with random weights, ``--layers`` of it, ``--dtype``), iterates

* ``export``: ``hf.export_weights(model, memory=True)`` (one tensor at a time);
* ``stream-<B>``: ``weights(model, "transformers", bucket_bytes=B)`` for each bucket size ``B``,
  each bucket dropped before the next (what a sender does after handing it over);

and records wall time, tensors and bytes streamed, the stream's own count of the bytes it held at
once (``peak_bytes``: the bucket plus gathered parameters) and, on CUDA, ``max_memory_allocated``
above the model. One process (no FSDP: a sharded model adds each parameter's gather).

    python benchmarks/weight_stream.py --flavor qwen3.5-35b-a3b --layers 1      # CPU, ~1 min, ~4 GB
    python benchmarks/weight_stream.py --flavor qwen3.5-35b-a3b --layers 4 --device cuda \\
        --out benchmarks/results/weight_stream_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

MIB = 1 << 20


def _run(name, make_iter, device, base):
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    tensors = total = buckets = largest = 0
    it = make_iter()
    for item in it:
        pairs = item if isinstance(item, list) else [item]
        buckets += 1
        for _, t in pairs:
            tensors += 1
            total += t.numel() * t.element_size()
            largest = max(largest, t.numel() * t.element_size())
        del item, pairs
    if cuda:
        torch.cuda.synchronize(device)
    row = {
        "case": name,
        "seconds": time.perf_counter() - t0,
        "tensors": tensors,
        "bytes": total,
        "buckets": buckets,
        "largest_tensor_bytes": largest,
        # export holds one assembled tensor at a time; the stream counts what it held
        "peak_held_bytes": getattr(it, "peak_bytes", largest),
    }
    if cuda:
        row["cuda_peak_above_model_bytes"] = torch.cuda.max_memory_allocated(device) - base
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="qwen3.5-35b-a3b")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--buckets-mib", default="64,512,2048", help="bucket sizes in MiB, comma-separated")
    p.add_argument("--repeat", type=int, default=2, help="runs per case; the fastest is kept")
    p.add_argument("--out", default=None, help="JSON file (default: print only)")
    a = p.parse_args(argv)

    import torch

    from harts_runtime import HybridModel, model_config
    from harts_runtime.engine.weights import weights
    from harts_runtime.hf import export_weights

    device = torch.device(a.device)
    cfg = model_config(a.flavor, a.layers).replace(dtype=a.dtype)
    with torch.device(device):
        model = HybridModel(cfg, device=device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    rows = [_run("export", lambda: export_weights(model, memory=True), device, base)]
    for mib in (int(x) for x in a.buckets_mib.split(",")):
        rows.append(
            _run(f"stream-{mib}MiB", lambda mib=mib: weights(model, "transformers", mib * MIB), device, base)
        )
    params = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    out = {
        "benchmark": "weight_stream",
        "flavor": a.flavor,
        "layers": a.layers,
        "dtype": a.dtype,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "host": platform.node(),
        "model_bytes": params,
        "rows": rows,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
