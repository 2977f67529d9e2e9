"""Bytes, not frames, bound what hostile control frames cost a decode agent (docs/security.md, "Bounds").

A real decode agent in its own process (decode_worker.py) takes near-limit frames, each a valid direct-path
Metadata of 2 million page ids (16 MiB on the wire, about 80 MiB once decoded), sealed with the deployment's
secret under a registered prefill rank's own id and session: an insider. A decode rank never takes a Metadata, so
the agent refuses each from its head without decoding it, and ZeroMQ's queue for the connection holds at most
`recv_queue_bytes`. The peak RSS stays within 256 MiB of the idle agent's (before the byte bounds: 2.47 GB under
150 such frames). benchmarks/hostile_memory.py measures the same, and the 100,000-frame fuzz, over 5 runs.
"""

from __future__ import annotations

import time

from deployment import DecodeProcess, prefill_instance

from kvstage.e2e.stranger import Stranger
from kvstage.protocol.codec import DEFAULT_MAX_FRAME_BYTES
from kvstage.protocol.messages import MAX_PAGES, PROTOCOL_VERSION, Envelope, Metadata
from kvstage.transport.bootstrap import BootstrapServer

SECRET = b"hostile memory test secret, 32 b"
FRAMES = 60  # far more than every buffer on the way holds (ZeroMQ's queue: 2 such frames)
MIB = 2**20


def near_limit_metadata(room: int) -> Metadata:
    """A valid direct-path Metadata of MAX_PAGES page ids whose frame is just under DEFAULT_MAX_FRAME_BYTES."""
    big = (DEFAULT_MAX_FRAME_BYTES - 4096 - 5 * MAX_PAGES) // 4  # ids above 2**32 take 9 msgpack bytes, others 5
    pages = tuple(range(2**32, 2**32 + big)) + tuple(range(2**16, 2**16 + MAX_PAGES - big))
    return Metadata(room=room, decode_rank=0, decode_tp=1, prefill_tp=2, num_tokens=4 * len(pages), prefix_tokens=0,
                    chunk_tokens=8, page_size=4, path="direct", epoch=1, ttl_s=30.0, pages=pages)  # fmt: skip


def test_an_insiders_near_limit_frames_peak_a_decode_agent_under_256_mib() -> None:
    with BootstrapServer(secret=SECRET) as bootstrap:
        decode = DecodeProcess(bootstrap.address, SECRET)
        prefill = prefill_instance("P", bootstrap.address, secret=SECRET)
        insider = Stranger(decode.address, SECRET)
        try:
            envelope = Envelope(PROTOCOL_VERSION, "P/0", prefill[0].session, 0, 1, None, near_limit_metadata(1))
            payload = insider.codec.encode(envelope)
            assert len(payload) > DEFAULT_MAX_FRAME_BYTES - 8192 and insider.auth is not None
            time.sleep(0.5)  # decode resolves the prefill ranks (their heartbeats) before the burst
            base = decode.ask_json("reset-peak")
            before = base["received"] + sum(base["rejected"].values())
            for _ in range(FRAMES):  # sealed anew each time: the same frame twice is dropped as a replay
                insider.send_raw(insider.auth.seal(payload, decode.address.encode()))
            deadline = time.monotonic() + 120
            while (state := decode.state())["received"] + sum(state["rejected"].values()) < before + FRAMES:
                assert time.monotonic() < deadline, f"decode never got through the frames: {state}"
                time.sleep(0.1)
        finally:
            insider.close()
            for agent in prefill:
                agent.close()
            decode.close()
    assert state["rejected"].get("undecodable", 0) >= FRAMES, state  # refused from its head, never decoded
    assert state["peak"] - base["rss"] < 256 * MIB, (base, state)
    print(f"\n{FRAMES} near-limit frames: peak RSS {(state['peak'] - base['rss']) / MIB:+.1f} MiB over idle")
