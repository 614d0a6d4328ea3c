"""Devices: opening files and block devices safely, their superblock layout, health states, a
striped device set (a peer's too, read-only), header scans, NVMe-oF namespace discovery.
"""
