"""How messages become bytes and back.

msgpack for the structure, raw bytes for arrays, exact types, the pickle opt-in, and
decoding whose cost stays linear in the bytes (hash flooding refused).
"""
