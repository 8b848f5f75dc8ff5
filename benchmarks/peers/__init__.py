"""bench_peers' parts: the orchestrator's side (``services``, ``report``) and the workers' (``worker``, ``drivers``)."""
