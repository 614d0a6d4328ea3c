"""The per-host service: its server, the client engines use, the wire protocol, shared
windows, metrics and KV events.
"""
