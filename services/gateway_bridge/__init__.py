"""gateway_bridge: the only process with upstream credentials.

Verifies NodeSpecs, publishes Hello and the inventory upstream, and forwards
the durable outbox until upstream acknowledges. Built in the bridge issue.
"""
