"""Call signatures and the envelopes that carry them: what the ranks of one call must agree on."""
