"""Tiers: the DRAM and disk tiers, their slot tables and eviction, placement policy and
admission, device availability and health, recovery of the disk index, counters.
"""
