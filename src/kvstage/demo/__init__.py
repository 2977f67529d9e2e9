"""kvstage.demo: the two demos behind `kvstage demo`, side by side.

- vllm.py, `kvstage demo`: prompts through a vLLM prefill server and a vLLM decode server of different TP sizes,
  the kvstage router in front, every request verified (KV bit-exact, tokens equal to a single-instance run). It
  starts its processes with the helpers of kvstage.e2e (model, servers, verify), which the end-to-end tests use
  too.
- synthetic.py, `kvstage demo --synthetic`: no vLLM and no model; kvstage's own agents and paged pools in one
  process, seeded random KV, byte-level checks against the staging plans.
- summary.py: the summary table both print.

Applications layer: imports e2e/, runtime/ and below, never the router or bench. Called by cli.py and the tests.
Nothing is re-exported here: import the demo you mean.
"""
