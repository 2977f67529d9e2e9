"""End-to-end tests with real vLLM servers (CPU build) and the kvstage connector, router and bootstrap."""
