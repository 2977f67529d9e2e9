"""One side of tests/e2e/test_hosts_agents.py's one-way cut, run as a script inside a host's namespace: a bare
mooncake transport (no agents), driven by one command per line on standard input, answering one JSON line each.

reader: allocates `--bytes` filled with CANARY and prints its descriptor (hex); `changed` answers how many bytes
no longer hold the canary.
writer: `import HEX` imports a reader's descriptor; `write OFFSET LENGTH [SLICES]` writes that much of a 0x5A source
into it, as one write of SLICES equal slices (default 1), and answers once the write completes, with its outcome and
how long it took."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from kvstage.transport.data import TransportConfig, create_transport
from kvstage.transport.data.base import RegionDescriptor, decode_descriptor, encode_descriptor
from kvstage.transport.data.loopback import wait_for

CANARY = 0xA5
SOURCE = 0x5A


def answer(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("reader", "writer"))
    ap.add_argument("--host", required=True)
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--max-write-s", type=float, default=None, help="the writer's max_write_s (none: unbounded)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    config = TransportConfig(backend="mooncake", host=args.host, max_write_s=args.max_write_s, write_timeout_s=90.0)
    with create_transport(config) as transport:
        if args.role == "reader":
            memory = torch.full((args.bytes,), CANARY, dtype=torch.uint8)
            region = transport.register(memory)
            answer(descriptor=encode_descriptor(transport.export(region)).hex())
        else:
            source = transport.register(torch.full((args.bytes,), SOURCE, dtype=torch.uint8))
        remote = None
        for line in sys.stdin:
            command, *rest = line.split()
            if command == "changed":
                answer(changed=int((memory != CANARY).sum()))
            elif command == "import":
                descriptor: RegionDescriptor = decode_descriptor(bytes.fromhex(rest[0]))
                remote = transport.import_remote(descriptor)
                answer(imported=True)
            elif command == "write":
                assert remote is not None, "import first"
                offset, length, count = (*map(int, rest), 1)[:3]
                step = length // count
                slices = [(offset + i * step, offset + i * step, step) for i in range(count)]
                start = time.monotonic()
                transfer = transport.write_batch(source, remote, slices)
                done = wait_for(transport, [transfer], timeout_s=120.0)[transfer]
                answer(ok=done.ok, reason=done.reason, seconds=round(time.monotonic() - start, 2))


if __name__ == "__main__":
    main()
