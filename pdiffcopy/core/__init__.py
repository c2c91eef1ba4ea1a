"""The core: block plans, digests, tree plans and filters, the wire codecs and protocol constants. No
I/O; imports only core and errors.
"""
