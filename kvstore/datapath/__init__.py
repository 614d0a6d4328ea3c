"""The data path between tiers: DRAM placement (reserving slots, writing victims down),
verified disk reads, the flusher, the prefetch ledger.
"""
