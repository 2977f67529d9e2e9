"""Moving KV bytes: paged KV pools, the engine's own KV (`EngineKV`), staged gather/scatter, and the direct
per-slice baseline (torch).

Owns the tensors; the arithmetic they follow (head mapping, block offsets, chunk grid) lives in `kvstage.layout`.
The same code runs on CPU and CUDA; on CUDA, copies are queued on a stream and a `CopyFence` (one event) says
when they have landed. Called by the runtime agents, the reference engine, the simulator, the demo
and the benchmarks.
"""

from kvstage.dataplane.direct import SliceCopy, copy_direct, plan_direct_slices, transfer_direct
from kvstage.dataplane.engine_kv import EngineKV, KVCacheFormat, KVStore
from kvstage.dataplane.fence import LANDED, CopyFence
from kvstage.dataplane.pool import (
    TORCH_DTYPES,
    KVPool,
    PageAllocator,
    PageGeometry,
    Plane,
    PoolGeometry,
    RequestSlots,
    torch_dtype,
)
from kvstage.dataplane.stage import (
    StagingBuffer,
    block_bytes,
    gather,
    gather_block,
    gather_slots,
    queue_scatter_region,
    scatter,
    scatter_block,
    scatter_region,
    scatter_region_slots,
    scatter_slots,
)

__all__ = [
    "LANDED",
    "TORCH_DTYPES",
    "CopyFence",
    "EngineKV",
    "KVCacheFormat",
    "KVPool",
    "KVStore",
    "PageAllocator",
    "PageGeometry",
    "Plane",
    "PoolGeometry",
    "RequestSlots",
    "SliceCopy",
    "StagingBuffer",
    "block_bytes",
    "copy_direct",
    "gather",
    "gather_block",
    "gather_slots",
    "plan_direct_slices",
    "queue_scatter_region",
    "scatter",
    "scatter_block",
    "scatter_region",
    "scatter_region_slots",
    "scatter_slots",
    "torch_dtype",
    "transfer_direct",
]
