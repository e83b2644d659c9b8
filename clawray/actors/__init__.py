"""Ray actors: rollout engines, judges, the trajectory queue, the session tracker and the learners.

Must not: import its modules (each is imported where it is used).
"""
