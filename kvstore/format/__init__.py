"""The record format's ground floor: chunk keys, the on-disk record header and its checksums,
sizes, errors, and the mask that keeps passwords out of what is printed. Imports nothing
else of kvstore.
"""
