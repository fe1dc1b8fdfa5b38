"""Benchmarks of the pool sharing itself: a trace replay of loaning against hard quotas
(:mod:`bench.sharing.replay`) and a gang of 1,536 members on a 100k pool
(:mod:`bench.sharing.gang_scale`)."""
