"""The node side of the marketplace: ``hpc-node-agent`` and the shared heartbeat and lifecycle models.

``heartbeat`` (wire models, canonical signing) and ``lifecycle`` (node states, workflow messages) are pure and
safe to import from workflows; ``config``, ``metrics``, ``latency``, ``sequence``, ``agent`` and ``cli`` are
the agent's own I/O and are never imported by workflow code.
"""
