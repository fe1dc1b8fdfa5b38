"""The write paths for nodes and gangs: compose, resize, release and forget, gangs,
queueing and admission, quotas and lending, and the checks a request passes before
anything is written. It may import state and placement, never control or api.
"""
