"""Pure functions of the RL update: advantages and policy losses (no Ray, no I/O)."""
