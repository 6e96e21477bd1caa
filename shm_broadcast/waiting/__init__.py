"""How a blocked queue side waits.

Spin-yield-park backoff, peer liveness, predictive sleeps and doorbells.
"""
