"""The ground floor: the vocabulary every other room shares, importing none of them (the store's
row-key constant aside): a call's record and its sinks, redaction, SSE framing, the hot path's
JSON, the facts a record says about itself (its harness, whether it was checked), and waiting
for a set of background tasks without spinning the event loop."""
