"""Ray actors: rollout engines, judges, the trajectory queue, the session tracker and the learners."""
