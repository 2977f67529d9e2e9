"""Engine adapters: they translate an engine's hooks into kvstage agent calls (`kvstage.runtime`).

Each adapter lives in its own subpackage and imports its engine lazily, so kvstage itself never needs one.
`kvstage.integrations.vllm` is vLLM's out-of-tree KV connector.
"""
