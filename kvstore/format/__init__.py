"""The record format's ground floor: chunk keys, the on-disk record header and its checksums,
sizes, errors. Imports nothing else of kvstore.
"""
