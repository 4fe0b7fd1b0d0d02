"""Pure machines and parsers: bytes and events in, decisions and events out. No IO, no clock, no asyncio.

Nothing here imports from the other subpackages but `records` (the record definitions, data only); everything
else is built on these.
"""
