"""What the nixl backend does with a descriptor whose metadata belongs to another agent than its owner: it refuses
it before loading anything, so a refused descriptor leaves no remote agent behind and does not touch a peer that is
already loaded. Real NIXL agents: a reader in its own process, the writer and an impostor in this one."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvstage.errors import TransportError
from kvstage.transport.data import RegionDescriptor, TransportConfig, create_transport
from kvstage.transport.data.loopback import ReaderPeer, digest, wait_for

pytest.importorskip("nixl_cu12")

REGION = 1 << 16


def config(name: str | None = None) -> TransportConfig:
    """A nixl config with a fresh agent name unless `name` is given (NIXL refuses a peer of its own name)."""
    if name is None:
        return TransportConfig(backend="nixl", write_timeout_s=20.0)
    return TransportConfig(backend="nixl", write_timeout_s=20.0, name=name)


def claimed_by(owner: str, real: RegionDescriptor) -> RegionDescriptor:
    return msgspec.structs.replace(real, owner=owner)


def test_descriptor_carrying_another_agents_metadata_is_refused_and_leaves_no_remote_agent_loaded() -> None:
    with ReaderPeer(config(), REGION) as reader, create_transport(config()) as writer:
        agent = reader.descriptor.owner
        with pytest.raises(TransportError, match=f"carries metadata of agent {agent!r}"):
            writer.import_remote(claimed_by("someone-else", reader.descriptor))

        assert not writer._agent.check_remote_metadata(agent), "the refused blob's agent stayed loaded"
        source = writer.register(torch.full((REGION,), 9, dtype=torch.uint8))
        remote = writer.import_remote(reader.descriptor)  # the genuine descriptor still imports and works
        done = writer.write(source, 0, remote, 0, REGION)
        assert wait_for(writer, [done], timeout_s=30)[done].ok
        assert reader.digest(0, REGION) == digest(source.tensor)


def test_refused_descriptor_naming_a_loaded_peer_leaves_that_peer_loaded_and_writable() -> None:
    with ReaderPeer(config(), REGION) as reader, create_transport(config()) as writer:
        agent = reader.descriptor.owner
        source = writer.register(torch.full((REGION,), 3, dtype=torch.uint8))
        remote = writer.import_remote(reader.descriptor)
        with create_transport(config(name=agent)) as impostor:  # an agent of the same name, other connections
            forged = claimed_by("someone-else", impostor.export(impostor.allocate(REGION)))
            with pytest.raises(TransportError, match=f"carries metadata of agent {agent!r}"):
                writer.import_remote(forged)

        assert writer._agent.check_remote_metadata(agent)
        done = writer.write(source, 0, remote, 0, REGION)
        assert wait_for(writer, [done], timeout_s=30)[done].ok, "the loaded peer no longer takes writes"
        assert reader.digest(0, REGION) == digest(source.tensor)


def test_descriptor_whose_metadata_is_not_a_nixl_agents_is_refused_without_loading_it() -> None:
    with create_transport(config()) as writer:
        payload = {"metadata": b"nixlSerDes|Conns garbage", "address": 4096, "memory": "DRAM", "device": 0}
        forged = RegionDescriptor("nixl", "someone", 1, 4096, msgspec.msgpack.encode(payload))
        with pytest.raises(TransportError, match="carries no NIXL agent header"):
            writer.import_remote(forged)
