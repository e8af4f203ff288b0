"""The wire codec's throughput against a memcpy of the same fp32 tensor, in the same run (issue 27).

For each scaled format (``fp4_e3m0``, ``int8``, ``fp8_e4m3``) and N values of a dense fp32
pseudo-gradient (standard normal):

- ``memcpy_s``: ``np.copyto`` of the N fp32 values into an allocated buffer (the baseline: one
  read and one write of 4 N bytes);
- ``encode_s``: the fused codec (``core.codec.encode``, what a replica and the outer side run on
  the host) with error feedback (residual in, new residual out), and ``encode_x`` its ratio to the
  memcpy;
- ``encode_plain_s``: the same without error feedback (``encode_plain_x`` its ratio);
- ``decode_add_s``: decoding one message into an fp32 accumulator (``core.codec.decode_into``
  with ``accumulate``: what a receiver does with the downlink), ``decode_add_x`` its ratio;
- ``torch_encode_s`` / ``torch_decode_add_s``: the torch codec this replaced on the host
  (``core.formats.WireFormat.encode_torch`` plus the error-feedback arithmetic; decode, then add),
  kept for tensors on a GPU, with ``speedup`` = torch encode / fused encode;
- ``values_per_s``: N / ``encode_s``.

Each figure is the median of ``--repeats`` runs after one warm-up (numba compiles on first use and
caches the machine code next to the module). The threads are torch's (``torch.get_num_threads()``).

    python benchmarks/codec.py [--values 1e8] [--formats fp4_e3m0 int8 fp8_e4m3] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from ray_diloco.core import codec
from ray_diloco.core.formats import FORMATS, wire_format


def timed(fn, repeats: int, warmup: int = 1) -> float:
    """The median seconds of ``repeats`` calls of ``fn`` after ``warmup`` calls (compile, first touch)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torch_encode(x: np.ndarray, r: np.ndarray, fmt: str) -> tuple:
    """The torch codec's encode with error feedback."""
    value = torch.from_numpy(x) + torch.from_numpy(r)
    f = wire_format(fmt)
    p, s = f.encode_torch(value)
    return p, s, value - f.decode_torch(p, s, value.numel())


def torch_decode_add(payload: np.ndarray, scales: np.ndarray, fmt: str, acc: np.ndarray) -> None:
    """The torch codec's decode, then an add into the accumulator."""
    vals = wire_format(fmt).decode_torch(torch.from_numpy(payload), torch.from_numpy(scales), acc.size)
    torch.from_numpy(acc).add_(vals)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=float, default=1e8)
    ap.add_argument("--formats", nargs="+", default=["fp4_e3m0", "int8", "fp8_e4m3"], choices=[f.name for f in FORMATS if f.scaled])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch", choices=["on", "off"], default="on", help="also time the torch codec (slow)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    n = int(a.values)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n, dtype=np.float32)
    r = (rng.standard_normal(n, dtype=np.float32) * 0.01).astype(np.float32)
    new_r, acc, dst = np.empty_like(x), np.zeros_like(x), np.empty_like(x)
    memcpy_s = timed(lambda: np.copyto(dst, x), a.repeats)
    rows = []
    for fmt in a.formats:
        payload, scales = codec.encode(x, fmt, r, new_r)
        plain = timed(lambda f=fmt: codec.encode(x, f), a.repeats)
        enc = timed(lambda f=fmt: codec.encode(x, f, r, new_r), a.repeats)
        dec = timed(lambda f=fmt, p=payload, s=scales: codec.decode_into(p, s, f, acc, accumulate=True), a.repeats)
        row = {"format": fmt, "values": n, "threads": torch.get_num_threads(), "memcpy_s": memcpy_s,
               "encode_plain_s": plain, "encode_plain_x": plain / memcpy_s, "encode_s": enc, "encode_x": enc / memcpy_s, "decode_add_s": dec, "decode_add_x": dec / memcpy_s,
               "values_per_s": n / enc}
        if a.torch == "on":
            row["torch_encode_s"] = timed(lambda f=fmt: torch_encode(x, r, f), 1)
            row["torch_decode_add_s"] = timed(lambda f=fmt, p=payload, s=scales: torch_decode_add(p, s, f, acc), 1)
            row["torch_encode_x"] = row["torch_encode_s"] / memcpy_s
            row["torch_decode_add_x"] = row["torch_decode_add_s"] / memcpy_s
            row["speedup"] = row["torch_encode_s"] / enc
        rows.append(row)
    print(f"{n / 1e6:.0f}M fp32 values, {torch.get_num_threads()} threads; memcpy {memcpy_s:.3f} s")
    print(f"{'format':10} {'plain enc s':>11} {'x memcpy':>9} {'EF enc s':>9} {'x memcpy':>9} {'dec+add s':>10} {'x memcpy':>9} "
          f"{'torch enc s':>12} {'torch dec+add s':>16} {'speedup':>8}")
    for row in rows:
        t = (f"{row['torch_encode_s']:>12.3f} {row['torch_decode_add_s']:>16.3f} {row['speedup']:>7.1f}x"
             if "speedup" in row else "")
        print(f"{row['format']:10} {row['encode_plain_s']:>11.3f} {row['encode_plain_x']:>8.1f}x "
              f"{row['encode_s']:>9.3f} {row['encode_x']:>8.1f}x {row['decode_add_s']:>10.3f} "
              f"{row['decode_add_x']:>8.1f}x {t}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"memcpy_s": memcpy_s, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
