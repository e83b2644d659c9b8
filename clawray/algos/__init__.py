"""Pure functions of the RL update: advantages and policy losses (no Ray, no I/O).

Owns: the update's rules (verdicts, credit, shaping, advantages, losses, guards). Must not: import Ray or
do I/O; the actors and the driver call these modules with plain values and callables.
"""
