"""Pure machines and parsers: bytes and events in, decisions and events out. No IO, no clock, no asyncio.

Nothing here imports from the other subpackages; everything else is built on these.
"""
