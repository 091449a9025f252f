"""One LLM call's lifecycle: the in-process gateway, the exchange with the policy server, SSE,
rollout identity, token-in replies, and the record (with its redaction) it leaves."""
