"""The data both the engine and the store speak: a prompt's segments and a chunk's K/V (``segments``), and the
source a blend reads cached K/V from layer by layer (``source``). A floor of its own below both, so that the
store needs nothing of the engine (only ``errors`` and torch)."""
