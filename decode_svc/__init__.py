"""The Decode service: reserves pages, receives pushed KV over UCX, decodes in one continuous batch."""
