"""What the router sends to its two upstream instances, and how their failures are named.

Owns:
- `new_room`: a room id, random in [1, 2**63);
- `prefill_body` / `decode_body`: the client's OpenAI body rewritten per the router contract (docs/vllm.md,
  "Router"): prefill gets one token, no streaming and the decode peer; decode gets the body unchanged plus the
  prefill peer, or no peer at all when it computes the prompt itself;
- `without_client_params`: the client's body without anything that could steer kvstage (clients never choose
  rooms): `kv_transfer_params`, top-level `kvstage_*` keys, and in `vllm_xargs` (which vLLM merges into the
  request's extra args, where the connector reads its params) `kv_transfer_params` and every `kvstage_*` key;
- `decode_only_reason`: why a request must be served by decode alone ("beam_search": vLLM runs beam search as
  engine requests it makes up itself, which no room can pair with prefill), or None;
- `upstream_headers`: the headers of every upstream request (request id, the upstream key; never the client's);
- `UpstreamFailure`: one failed upstream request, with the instance, a short reason from a fixed vocabulary
  (`connect`, `timeout`, `protocol`, `http_5xx`, `http_4xx`; from the TP lookup `unregistered` and `bootstrap`;
  `unavailable` when no instance of a role can take a request) and the HTTP status the client gets; whether it
  blames the instance (its breaker counts it) and whether another instance may succeed (a retry);
- `failure_from_exception` / `failure_from_response`: httpx errors and upstream error replies as `UpstreamFailure`;
- `read_bounded`: an upstream body read up to a byte limit (error messages are never buffered without bound).

Invariants: the body builders are pure (they copy, never mutate the client's body), and every body they build
has gone through `without_client_params`. Called by `router.proxy` and `router.health`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Final

import httpx

from kvstage.router.instances import Instance

MAX_ROOM = 2**63
ERROR_BODY_BYTES = 64 * 1024
KVSTAGE_PREFIX: Final = "kvstage_"
TRANSFER_PARAMS: Final = "kv_transfer_params"
XARGS: Final = "vllm_xargs"
# What pydantic (vLLM's request models) reads as true for a bool field.
_TRUE: Final = frozenset({"1", "true", "t", "yes", "y", "on"})
# Failures that say something about the instance (not about the request): they count against its breaker.
_INSTANCE_REASONS: Final = frozenset({"connect", "timeout", "protocol", "http_5xx"})

JSONBody = dict[str, Any]


def new_room() -> int:
    return 1 + secrets.randbelow(MAX_ROOM - 1)


def _transfer_params(room: int, peer: Instance, peer_tp: int) -> JSONBody:
    return {"kvstage_room": room, "kvstage_peer": peer.name, "kvstage_peer_tp": peer_tp}


def _steers_kvstage(key: str) -> bool:
    return key == TRANSFER_PARAMS or key.lower().startswith(KVSTAGE_PREFIX)


def without_client_params(body: JSONBody) -> JSONBody:
    """A copy of the client's body without anything that could reach kvstage's connector params."""
    out = {k: v for k, v in body.items() if not _steers_kvstage(k)}
    xargs = out.get(XARGS)
    if isinstance(xargs, dict):
        out[XARGS] = {k: v for k, v in xargs.items() if not _steers_kvstage(k)}
    return out


def decode_only_reason(body: JSONBody) -> str | None:
    """Why the request must be served by decode alone ("beam_search" when the client asks for it), or None."""
    flag = body.get("use_beam_search")
    if flag is True or (isinstance(flag, int | str) and str(flag).lower() in _TRUE):
        return "beam_search"
    return None


def prefill_body(body: JSONBody, *, chat: bool, room: int, decode: Instance, decode_tp: int) -> JSONBody:
    """The client's body for prefill: one token, not streamed (so no stream_options or min_tokens), decode as peer.

    Everything else is kept, `n` and a list of prompts included: each engine request vLLM makes of them has its
    counterpart on decode."""
    out = {k: v for k, v in without_client_params(body).items() if k not in ("stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params=_transfer_params(room, decode, decode_tp))
    if chat:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: JSONBody, *, room: int | None, prefill: Instance | None, prefill_tp: int) -> JSONBody:
    """The client's body for decode, with prefill as peer; without a prefill (`None`) decode computes it all."""
    out = without_client_params(body)
    if room is not None and prefill is not None:
        out[TRANSFER_PARAMS] = _transfer_params(room, prefill, prefill_tp)
    return out


def upstream_headers(request_id: str, api_key: str | None) -> dict[str, str]:
    """Headers of an upstream request: vLLM takes `X-Request-Id` as its request id; answers are relayed as they are,
    so never compressed; the upstream key is the router's own (a client's `Authorization` never goes upstream)."""
    headers = {"accept-encoding": "identity", "x-request-id": request_id}
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


@dataclass(frozen=True)
class UpstreamFailure(Exception):
    instance: Instance
    reason: str
    status: int  # what the client gets when this fails its request
    detail: str

    def __str__(self) -> str:
        return f"{self.instance.describe()}: {self.reason}: {self.detail}"

    @property
    def blames_instance(self) -> bool:
        """The instance failed (down, broken, too slow), as opposed to refusing this request or being unknown."""
        return self.reason in _INSTANCE_REASONS

    @property
    def retryable(self) -> bool:
        """Another instance may well succeed where this one failed: not when the request was refused, nor when the
        bootstrap cannot be asked (no other instance's lookup would fare better)."""
        return self.reason not in ("http_4xx", "bootstrap")

    def error_body(self) -> JSONBody:
        """An OpenAI-style error body naming the instance and the reason."""
        return {
            "error": {
                "message": str(self),
                "type": "upstream_error",
                "code": self.status,
                "instance": self.instance.name,
                "role": self.instance.role,
                "reason": self.reason,
            }
        }


def failure_from_exception(instance: Instance, exc: httpx.HTTPError) -> UpstreamFailure:
    """Connect errors are 503 (the instance is down), timeouts 504, a broken connection 502."""
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return UpstreamFailure(instance, "connect", 503, detail)
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamFailure(instance, "timeout", 504, detail)
    return UpstreamFailure(instance, "protocol", 502, detail)


async def read_bounded(response: httpx.Response, limit: int = ERROR_BODY_BYTES) -> bytes:
    """At most `limit` bytes of the response's body; the rest is not read."""
    out = bytearray()
    async for chunk in response.aiter_raw():
        out += chunk[: limit - len(out)]
        if len(out) >= limit:
            break
    return bytes(out)


def upstream_message(raw: bytes) -> str:
    """The message of an upstream error body (OpenAI's {"error": {"message"}} or vLLM's {"message"}), else its text."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace").strip()
    if isinstance(body, dict):
        inner = body.get("error", body)
        message = inner.get("message") if isinstance(inner, dict) else None
        if isinstance(message, str):
            return message
    return raw.decode(errors="replace").strip()


def failure_from_response(instance: Instance, status: int, raw: bytes) -> UpstreamFailure:
    """An upstream 5xx is the client's 502; a 4xx keeps its status (the client's request was refused)."""
    message = upstream_message(raw) or "(empty body)"
    if status >= 500:
        return UpstreamFailure(instance, "http_5xx", 502, f"HTTP {status}: {message}")
    return UpstreamFailure(instance, "http_4xx", status, f"HTTP {status}: {message}")
