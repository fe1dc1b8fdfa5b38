"""What the broker holds and how it commits: the cache of every etcd record,
read-modify-commit over it (stm), locks, record rules, pagination, and the indexes and
tallies kept current from cache events. It may import placement only.
"""
