"""Simulated users that drive the policy endpoint like a real agent client would."""
