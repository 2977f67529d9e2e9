"""Raw loopback bandwidth of the data transports: one bulk write versus the same bytes as many small writes.

For each backend, a reader process registers a region and this process writes into it over the backend: once as
a single bulk write, once as `size / slice_bytes` scattered slices (submitted in batches, one operation each).
It prints GB/s of both, the operations each issued, and the bulk/per-slice ratio. Quick by default.

    python benchmarks/raw_bulk.py --backend local --backend mooncake --backend nixl --size-mib 64 --slice-bytes 4096
"""

from __future__ import annotations

import argparse
import json

from kvstage.transport.data import BACKENDS, TransportConfig
from kvstage.transport.data.loopback import RawBulkResult, measure_raw_bulk


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", choices=BACKENDS, help="repeatable; default: all")
    parser.add_argument("--size-mib", type=int, default=64, help="bytes written per measurement, in MiB")
    parser.add_argument("--slice-bytes", type=int, default=4096, help="size of one per-slice write")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--batch-slices", type=int, default=4096, help="slices per write_batch call")
    parser.add_argument("--json", action="store_true", help="also print one JSON object per backend")
    return parser.parse_args()


def row(result: RawBulkResult) -> str:
    return (
        f"{result.backend:<9} {result.nbytes / 2**20:>8.0f} {result.bulk_gbps:>10.2f} {result.bulk_ops:>9} "
        f"{result.slice_gbps:>11.3f} {result.slice_ops:>10} {result.bulk_over_slice:>12.1f}x"
    )


def main() -> None:
    args = parse_args()
    print(
        f"{'backend':<9} {'MiB':>8} {'bulk GB/s':>10} {'bulk ops':>9} {'slice GB/s':>11} {'slice ops':>10} "
        f"{'bulk/slice':>13}"
    )
    for backend in args.backend or list(BACKENDS):
        result = measure_raw_bulk(
            TransportConfig(backend=backend),
            args.size_mib << 20,
            args.slice_bytes,
            repeats=args.repeats,
            batch_slices=args.batch_slices,
        )
        print(row(result), flush=True)
        if args.json:
            print(
                json.dumps(
                    {
                        "backend": backend,
                        "bulk_gbps": result.bulk_gbps,
                        "slice_gbps": result.slice_gbps,
                        "bulk_ops": result.bulk_ops,
                        "slice_ops": result.slice_ops,
                        "slice_bytes": result.slice_bytes,
                        "nbytes": result.nbytes,
                    }
                )
            )


if __name__ == "__main__":
    main()
