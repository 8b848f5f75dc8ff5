"""The tools built on the store: request traces (``trace``), the trace simulator (``sim``), the load test
(``loadtest``), the prefill-reuse demo (``demo``) and the command-line views of a node (``explain_cli``,
``stats_view``). Nothing in the store, the node, the clients or the connectors imports them.
"""
