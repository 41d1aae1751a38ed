"""Verification: the verdict on a plan in fresh processes, and the ablation of a verified plan; both measure
through tpu_agent.measure, as the search does, and neither imports the search."""
