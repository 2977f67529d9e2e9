"""The middlewares that put vLLM servers behind sglang-router: each turns the fields sglang-router adds to a request
body (`bootstrap_room`, `bootstrap_host`, `bootstrap_port`) into the connector's `kv_transfer_params`, and lets
every other request through unchanged. Driven over HTTP into a real ASGI app that echoes what reached it, with a
real `kvstage bootstrap` for decode's lookup of the prefill instance; tests/e2e/test_vllm_sglang_router.py runs
them in vLLM behind the real router.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI, Request

from kvstage.integrations.vllm.params import parse_params
from kvstage.integrations.vllm.sglang_router import DecodeBehindSGLangRouter, PrefillBehindSGLangRouter
from kvstage.layout import KVLayout
from kvstage.transport.bootstrap import BootstrapClient, BootstrapServer, LayoutRecord, PeerRecord

ROOM = 1812142526926113449
ROUTED = {"bootstrap_host": "10.0.0.2", "bootstrap_port": 8100, "bootstrap_room": ROOM}


def record(instance: str, role: str, tp: int, rank: int, url: str) -> PeerRecord:
    """A rank's bootstrap record, as the connector publishes it with its `url` setting."""
    layout = LayoutRecord.of(KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32", page_size=16))
    return PeerRecord(peer_id=f"{instance}-{rank}", role=role, instance=instance, tp_size=tp,  # type: ignore[arg-type]
                      rank=rank, layout=layout, control_address="tcp://127.0.0.1:1", backend="local", session=1,
                      url=url)  # fmt: skip


def _echo() -> FastAPI:
    app = FastAPI()

    @app.post("/{path:path}")
    async def echo(path: str, request: Request) -> dict[str, Any]:
        body = await request.body()
        assert int(request.headers["content-length"]) == len(body)
        return {"path": path, "body": json.loads(body)}

    return app


def _post(middleware: Any, body: dict[str, Any], path: str = "/v1/completions") -> dict[str, Any]:
    transport = httpx.ASGITransport(app=middleware)

    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
            reply = await client.post(path, content=json.dumps(body))
            reply.raise_for_status()
            return dict(reply.json()["body"])

    return anyio.run(go)


@pytest.fixture
def bootstrap(monkeypatch: pytest.MonkeyPatch) -> Iterator[BootstrapClient]:
    with BootstrapServer() as server:
        monkeypatch.setenv("KVSTAGE_BOOTSTRAP", server.address)
        yield BootstrapClient(server.address)


def test_prefill_gets_the_router_room_for_a_remote_decode_and_generates_one_token() -> None:
    got = _post(PrefillBehindSGLangRouter(_echo()), {"model": "m", "prompt": "hi", "max_tokens": 64, **ROUTED})
    assert got == {"model": "m", "prompt": "hi", "max_tokens": 1,
                   "kv_transfer_params": {"do_remote_decode": True, "kvstage_room": ROOM}}  # fmt: skip
    assert parse_params(got["kv_transfer_params"], producer=True).room == ROOM  # type: ignore[union-attr]
    chat = {"model": "m", "messages": [], "max_completion_tokens": 9, **ROUTED}
    got = _post(PrefillBehindSGLangRouter(_echo()), chat, "/v1/chat/completions")
    assert got["max_completion_tokens"] == 1 and "max_tokens" not in got


def test_decode_gets_the_room_and_the_prefill_instance_that_publishes_the_bootstrap_host_and_port(
    bootstrap: BootstrapClient,
) -> None:
    for rank in range(2):
        bootstrap.register(record("P", "prefill", 2, rank, "http://10.0.0.2:8100"))
    bootstrap.register(record("Q", "prefill", 1, 0, "http://10.0.0.2:8101"))
    got = _post(DecodeBehindSGLangRouter(_echo()), {"model": "m", "prompt": "hi", "max_tokens": 64, **ROUTED})
    assert got == {"model": "m", "prompt": "hi", "max_tokens": 64,
                   "kv_transfer_params": {"kvstage_room": ROOM, "kvstage_peer": "P", "kvstage_peer_tp": 2}}  # fmt: skip


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": "no router fields"},
        {"model": "m", "prompt": "x", **ROUTED, "kv_transfer_params": {"kvstage_room": 7}},
        {"model": "m", "prompt": "x", **ROUTED, "bootstrap_room": "7"},
        {"model": "m", "prompt": "x", **ROUTED, "bootstrap_room": 0},
    ],
    ids=["no router fields", "params already named", "room not an int", "room 0"],
)
def test_a_request_the_middleware_cannot_or_need_not_turn_passes_unchanged(body: dict[str, Any]) -> None:
    middleware = PrefillBehindSGLangRouter(_echo())
    assert _post(middleware, body) == body


def test_a_decode_request_whose_prefill_the_directory_does_not_know_runs_without_kvstage_and_is_counted(
    bootstrap: BootstrapClient,
) -> None:
    bootstrap.register(record("P", "prefill", 1, 0, "http://10.0.0.9:8100"))
    middleware = DecodeBehindSGLangRouter(_echo())
    body = {"model": "m", "prompt": "hi", **ROUTED}
    assert _post(middleware, body) == body
    assert middleware.counts == {"no prefill for bootstrap_host:bootstrap_port": 1}


def test_other_routes_and_methods_pass_untouched() -> None:
    middleware = PrefillBehindSGLangRouter(_echo())
    assert _post(middleware, {"prompt": "x", **ROUTED}, "/v1/embeddings") == {"prompt": "x", **ROUTED}
