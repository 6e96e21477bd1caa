"""How a blocked queue side waits: spin-yield-park backoff, peer liveness, predictive sleeps and doorbells."""
