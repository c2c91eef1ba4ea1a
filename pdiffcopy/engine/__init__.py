"""The engine: endpoint interfaces, the file and tree sync jobs. Imports core and errors; local/ and
transport/ implement its interfaces, api.py wires them.
"""
