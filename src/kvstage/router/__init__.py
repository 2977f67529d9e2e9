"""`kvstage router`: an OpenAI-compatible prefill/decode proxy in front of vLLM servers running KVStageConnector.

Application layer. `app` serves the HTTP endpoints (request ids, the client key, the OpenAI error shape); `proxy`
runs each client request through a prefill and a decode instance, with retries on another decode instance and
fallbacks to decode alone; `core` holds the state requests share (instances, choices by policy, metrics);
`discovery` follows the instances registered with the bootstrap (`--discover`); `health` keeps each instance's
circuit breaker, `/health` probe and load, and hands out instances; `select` holds the policies (round robin,
least load, prefix affinity with bounded loads); `vllm_metrics` reads a vLLM server's `/metrics`; `instances`
names the instances and looks up their TP sizes from the bootstrap in the background; `upstream` rewrites the
bodies per the router contract and names failures; `config` holds the settings; `metrics` the Prometheus
metrics. Called by `kvstage router` (cli.py).
"""
