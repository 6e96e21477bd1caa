"""How messages become bytes and back.

msgpack for the structure, raw bytes for arrays, exact types, and the pickle opt-in.
"""
