"""Chaos scenarios: kills, pauses, Redis outages and redeliveries against real workers."""
