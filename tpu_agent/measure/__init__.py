"""Measuring: warm processes stepped in turns, and what their pairs say (ratio, interval, memory, numerics).

The search and the verification both measure through this package and neither imports the other.
"""
