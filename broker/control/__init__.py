"""The broker's loops: the node controller, the leader's duties (queue dispatch,
preemption notices, drains, fencing through the box fabric) and the agent sessions
that keep hosts alive. It may import nodes, state and placement, never api.
"""
