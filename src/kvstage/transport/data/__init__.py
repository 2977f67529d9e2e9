"""Data transports: one-sided bulk writes into a peer's registered memory (local shm, Mooncake TE, NIXL, CUDA IPC).

Owns: the factory `create_transport`, which imports a backend only when it is chosen, so a missing optional
package matters only to the user who picks that backend (`TransportUnavailable` names the pip extra).
Called by the runtime agents, `kvstage bench` and `benchmarks/raw_bulk.py`. The interface is in `base.py`.
"""

from __future__ import annotations

from kvstage.transport.data.base import (
    BACKENDS,
    Completion,
    DataTransport,
    LocalRegion,
    RegionDescriptor,
    RemoteRegion,
    Slice,
    TransportConfig,
    decode_descriptor,
    encode_descriptor,
)

__all__ = [
    "BACKENDS",
    "Completion",
    "DataTransport",
    "LocalRegion",
    "RegionDescriptor",
    "RemoteRegion",
    "Slice",
    "TransportConfig",
    "create_transport",
    "decode_descriptor",
    "encode_descriptor",
]


def create_transport(config: TransportConfig) -> DataTransport:
    """Build the backend `config.backend` names; raises `TransportUnavailable` if its package is missing."""
    if config.backend == "mooncake":
        from kvstage.transport.data.mooncake import MooncakeTransport

        return MooncakeTransport(config)
    if config.backend == "cuda_ipc":
        from kvstage.transport.data.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(config)
    if config.backend == "nixl":
        from kvstage.transport.data.nixl import NixlTransport

        return NixlTransport(config)
    from kvstage.transport.data.local import LocalTransport

    return LocalTransport(config)
