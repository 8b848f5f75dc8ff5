"""The block format: what a stored block is, as bytes and as tensors.

``format`` is the header (magic, version, dtype, layout, shape, checksum) and its checks; ``tensors``
encodes KV tensors into blocks and decodes them back (the exact format, handing lossy blocks to
``encoding``); ``encoding`` holds the lossy KV encodings (quantization, ``docs/encodings.md``);
``copying`` copies encoded blocks into caller tensors and tensors into tier memory; ``lease`` is the
handle of blocks read in place (``BlockLease``).
"""
