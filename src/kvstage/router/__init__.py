"""`kvstage router`: an OpenAI-compatible prefill/decode proxy in front of vLLM servers running KVStageConnector.

Application layer. `app` serves the HTTP endpoints and runs each request's two upstream requests; `upstream`
rewrites the bodies per the router contract and names failures; `instances` picks instances and looks up their
TP sizes from the bootstrap; `metrics` holds the Prometheus metrics. Called by `kvstage router` (cli.py).
"""
