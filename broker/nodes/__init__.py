"""The write paths for nodes and gangs: compose, resize, release and forget, gangs,
queueing and admission, quotas and lending, the checks a request passes before anything
is written, and the in-memory pool of the embedding API. It may import state and
placement, never control or api.
"""
