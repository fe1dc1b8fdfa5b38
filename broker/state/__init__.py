"""What the broker holds and how it commits: the cache of every etcd record, the one
read-modify-commit path (stm), locks, record rules, and the indexes and tallies kept
current from cache events. It may import placement only.
"""
