"""SSD pieces: fan-out (Theorem 12), Saguaro sampling (Definition 14), the strategy rule (Theorem 17)."""
