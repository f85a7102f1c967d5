"""The stored form and nothing else: layout and schema version, columns, commits, the manifest, index, spool, start
states and frame codes.
"""
