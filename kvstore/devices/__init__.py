"""Devices: opening files and block devices safely, their superblock layout, health states
and the watch that moves a tier's devices out of and back into service, a striped device
set (a peer's too, read-only), header scans, NVMe-oF namespace discovery.
"""
