"""How messages become bytes and back: msgpack structure, raw array payloads, exact types, and the pickle opt-in."""
