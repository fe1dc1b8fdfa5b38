"""The gRPC edge of the broker and the broker process itself: the server, the agent
port, the services, and what every call passes through (authentication, decoding,
size limits, audit, streams, health). It may import every wing below it: control,
nodes, state and placement.
"""
