"""Devices: opening files and block devices safely, their superblock layout, health states, a
striped device set, header scans, NVMe-oF namespace discovery.
"""
