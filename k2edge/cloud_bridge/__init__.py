"""Cloud offload to the full Kimi K2 server (escalation policy, K2 client, outbox, breaker).

Placeholder: nothing here yet. The bridge is built on top of the daemon (see the open issues);
this package exists so the layout matches the design.
"""
