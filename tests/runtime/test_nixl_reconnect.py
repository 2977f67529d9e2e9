"""A prefill rank whose NIXL connection to a live decode peer fails makes it again (issue 26: after a one-way link
cut, one rank's UCX endpoint stayed failed and every write failed with NIXL_ERR_REMOTE_DISCONNECT while decode was
alive). Real NIXL agents in one process, UCX over TCP; the failure is made by shutting down UCX's TCP connections
(not the control plane's) while both agents run, which fails the endpoints as a cut that outlasts
UCX_TCP_USER_TIMEOUT does."""

from __future__ import annotations

import errno
import socket
import time

import pytest
import torch
from agent_outcomes import wait_outcomes

from kvstage.dataplane import KVPool
from kvstage.layout import KVLayout, heads_of_rank
from kvstage.protocol import Timing
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, peer_id
from kvstage.runtime.imports import IMPORT_RETRY_S
from kvstage.transport.bootstrap import BootstrapServer
from kvstage.transport.data import TransportConfig
from kvstage.transport.data.tcp_guard import ESTABLISHED, tcp_sockets, tcp_table

pytest.importorskip("nixl_cu12")

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, dtype="float16", page_size=4)
TIMING = Timing(heartbeat_s=0.1, dead_after_s=5.0, retry_initial_s=0.02, retry_max_s=0.2)
CHUNK = 8
TOKENS = 24
PREFILL_TP = 2


def _byte_view(pool: KVPool) -> torch.Tensor:
    return pool.flat.view(2, LAYOUT.num_layers, pool.geometry.num_slots, pool.num_heads, LAYOUT.head_bytes)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def shut_down_tcp_except(kept_ports: set[int]) -> int:
    """Shut down (both ways) every established TCP connection of this process that touches none of `kept_ports`;
    returns how many. UCX closes its side of a connection once the other is shut down, so every descriptor is
    duplicated first, before any is shut down."""
    table = tcp_table()
    held = []
    for inode, sock in tcp_sockets():
        row = table.get(inode)
        if row is not None and row.state == ESTABLISHED and not kept_ports & {sock.getsockname()[1], row.peer[1]}:
            held.append(sock.dup())
    for sock in held:
        with sock:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError as err:  # its other end, in this process too, was shut down first
                if err.errno != errno.ENOTCONN:
                    raise
    return len(held)


class Cluster:
    """Prefill TP=2 -> decode TP=1 over NIXL (the staged path), UCX over TCP only."""

    def __init__(self) -> None:
        self.bootstrap = BootstrapServer().start()
        self.prefill = [self._agent(PrefillAgent, "P", PREFILL_TP, rank) for rank in range(PREFILL_TP)]
        self.decode = self._agent(DecodeAgent, "D", 1, 0)

    def _agent(self, cls, instance: str, tp: int, rank: int):
        pool = KVPool.for_rank(LAYOUT, tp, rank, num_pages=64)
        config = AgentConfig(
            instance=instance,
            rank=rank,
            tp_size=tp,
            layout=LAYOUT,
            bootstrap=self.bootstrap.address,
            transport=TransportConfig(backend="nixl", write_timeout_s=10.0),
            timing=TIMING,
            chunk_tokens=CHUNK,
            ring_bytes=16384,
            staging_bytes=16384,
        )
        return cls(config, pool).start()

    def control_ports(self) -> set[int]:
        return {_port(self.bootstrap.address)} | {_port(r.control_address) for r in self.bootstrap.records()}

    def hand_off(self, room: int) -> tuple[bool, bool]:
        """Hand one room off (random KV); whether it succeeded on decode, and whether what landed is prefill's KV."""
        kv = torch.randint(0, 256, (2, LAYOUT.num_layers, TOKENS, LAYOUT.num_kv_heads, LAYOUT.head_bytes))
        kv = kv.to(torch.uint8)
        npages = -(-TOKENS // LAYOUT.page_size)
        decode_pages = self.decode.pool.allocator.allocate(npages, room)
        prefill_peers = tuple(peer_id("P", r) for r in range(PREFILL_TP))
        self.decode.expect_room(room, prefill_peers, TOKENS, 0, tuple(decode_pages), timeout_s=20)
        for rank, agent in enumerate(self.prefill):
            pages = agent.pool.allocator.allocate(npages, room)
            heads = heads_of_rank(LAYOUT.num_kv_heads, PREFILL_TP, rank)
            slots = agent.pool.slot_indices(pages, 0, TOKENS)
            _byte_view(agent.pool).index_copy_(2, slots, kv[:, :, :, heads.start : heads.stop])
            agent.attach_room(room, TOKENS, 1, timeout_s=20)
            agent.compute_scheduled(room, TOKENS)
            agent.kv_ready(room, TOKENS, tuple(pages))
        ok = wait_outcomes(self.decode, 1)[room].ok
        for agent in self.prefill:
            wait_outcomes(agent, 1)
        slots = self.decode.pool.slot_indices(decode_pages, 0, TOKENS)
        return ok, torch.equal(_byte_view(self.decode.pool).index_select(2, slots), kv)

    def close(self) -> None:
        for agent in [self.decode, *self.prefill]:
            agent.close()
        self.bootstrap.close()


@pytest.fixture
def cluster(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")  # read when each agent's UCX context is made: connections we can find
    made = Cluster()
    yield made
    made.close()


def reconnects(agent: PrefillAgent) -> float:
    return agent.metrics.value("kvstage_peer_reconnects_total")


def test_a_live_decode_peer_whose_nixl_writes_fail_as_disconnected_is_imported_again_and_written_to(cluster):
    assert cluster.hand_off(1) == (True, True)
    assert shut_down_tcp_except(cluster.control_ports()) > 0, "no UCX connection over TCP to shut down"
    time.sleep(0.5)  # UCX's progress threads see the connections close and fail their endpoints

    ok, _ = cluster.hand_off(2)  # its writes fail at once (NIXL_ERR_REMOTE_DISCONNECT): decode still answers
    assert not ok, "a room was handed off over failed UCX endpoints: the connections were not cut"
    # A rank meets its failed endpoint at its first write after the cut. Decode may abort room 2 on the first
    # rank's failure before the other rank writes, which then fails (and reconnects) in the next room instead.
    room = 3
    while 0.0 in [reconnects(agent) for agent in cluster.prefill]:
        assert room < 3 + PREFILL_TP, "a rank never met its failed endpoint, or did not reconnect when it did"
        time.sleep(IMPORT_RETRY_S)
        assert not cluster.hand_off(room)[0], "a room was handed off over a rank's failed UCX endpoint"
        room += 1

    time.sleep(IMPORT_RETRY_S)  # the next write imports the peer again, which connects anew
    assert cluster.hand_off(room) == (True, True), "the decode peer was not written to again after the disconnect"
    assert cluster.hand_off(room + 1) == (True, True)
    # one reconnect per prefill rank: the room's other failed writes and the healthy rooms after make none
    assert [reconnects(agent) for agent in cluster.prefill] == [1.0] * PREFILL_TP
