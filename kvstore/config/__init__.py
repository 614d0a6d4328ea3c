"""Configuration: the schema helpers, the store's config models, the NVMe-oF config and the
private runtime directory. Above the format floor only.
"""
